"""HuggingFace transformers' TransfoXL generating with its mems: what a PyTorch user would try first. A peer in the
benchmark, not a runtime of the project: built from the same weights as every other side (`checkpoints/
huggingface.py`'s rules inverted), its memory started empty as the paper's. How it is driven: docs/benchmarks.md
("Peers")."""

from __future__ import annotations

import contextlib
import re
import warnings

from txl_deploy.bench.eager_baseline import EagerAtPositions
from txl_deploy.checkpoints.huggingface import HF_RULES
from txl_deploy.checkpoints.keymap import Rule, rename
from txl_deploy.errors import InputError

GROUP = re.compile(r"\((?:[^()\\]|\\.)*\)")  # a group of a rule's pattern, such as (\d+) or (weight|bias)


def inverted(rule: Rule) -> Rule:
    """HF_RULES' rule read backwards: our name -> HuggingFace's (`reverse_rows`, the one transform, is its own
    inverse). Each rule's target names its groups in order (\\1, \\2, ...)."""
    groups = GROUP.findall(rule.pattern)
    parts = re.split(r"\\(\d)", rule.target)  # literal, group number, literal, ...
    pattern = "".join(groups[int(x) - 1] if i % 2 else re.escape(x) for i, x in enumerate(parts))
    literals = [re.sub(r"\\(.)", r"\1", x) for x in GROUP.split(rule.pattern)]
    target = "".join(f"\\{i}{x}" if i else x for i, x in enumerate(literals))
    return Rule(pattern, target, rule.transform)


TO_HF_RULES = [inverted(rule) for rule in HF_RULES]


@contextlib.contextmanager
def transformers_on_current_torch():
    """`Tensor.type_as(dtype=...)` (the deprecated TransfoXL's call) as `.to(dtype)`, for the duration of a call."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    original = torch.Tensor.type_as
    torch.Tensor.type_as = lambda self, other=None, dtype=None: self.to(dtype) if other is None else original(self,
                                                                                                             other)
    try:
        yield
    finally:
        torch.Tensor.type_as = original


def to_huggingface(model):
    """A `TransfoXLLMHeadModel` computing what our `MemTransformerLM` `model` computes, from its weights."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here
    from transformers.models.deprecated import transfo_xl  # optional (the test extra: a peer the bench compares)

    cfg = model.cfg
    if cfg.same_length_extra:
        raise InputError("HuggingFace's same_length window has no variant that sees one key more (NVIDIA's)")
    hf_cfg = transfo_xl.TransfoXLConfig(
        vocab_size=cfg.n_token, cutoffs=list(cfg.cutoffs), d_model=cfg.d_model, d_embed=cfg.d_embed,
        n_head=cfg.n_head, d_head=cfg.d_head, d_inner=cfg.d_inner, div_val=cfg.div_val, pre_lnorm=cfg.pre_lnorm,
        n_layer=cfg.n_layer, mem_len=cfg.mem_len, clamp_len=cfg.clamp_len, same_length=cfg.same_length,
        untie_r=cfg.untie_r, tie_word_embeddings=cfg.tie_weight, dropout=0.0, dropatt=0.0,
        layer_norm_epsilon=cfg.layer_norm_epsilon)
    hf_cfg.tie_projs = list(cfg.tie_projs)  # our ties exactly (HF's own flag only knows "all but the first")
    from transformers.utils import logging as hf_logging  # optional (the test extra: a peer the bench compares)

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notices about the deprecated class, here for a benchmark
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transfo_xl.TransfoXLLMHeadModel(hf_cfg).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    state = rename(model.state_dict(), TO_HF_RULES, "txl-deploy model", "txl-deploy")
    # A parameter HuggingFace shares under several names (the r-biases without untie_r, tied weights) takes the
    # value given for any of them.
    aliases = {}
    for name, tensor in hf.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
    for names in aliases.values():
        given = next((state[n] for n in names if n in state), None)
        if given is not None:
            state.update({n: given for n in names if n not in state})
    with torch.no_grad():  # assign: HuggingFace's parameters are our tensors, not copies of them
        missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise InputError(f"the HuggingFace model does not take these weights (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    return hf


def with_generate(hf):
    """`hf` (a TransfoXLLMHeadModel) with a working `generate` and no stop id unless a call names one. transformers
    4.56's deprecated class lacks `GenerationMixin`, and `generate` would pass its default cache as `mems`: the
    class gets the mixin back and opts out of that cache (as xlnet does); TransfoXL's own `_reorder_cache` then
    reorders its `mems` for beam search."""
    from transformers import GenerationConfig, GenerationMixin  # optional (the test extra: a peer the bench compares)

    class TransfoXLGenerating(type(hf), GenerationMixin):
        @classmethod
        def _supports_default_dynamic_cache(cls):
            return False  # the model keeps its own `mems` list

    hf.__class__ = TransfoXLGenerating
    hf.generation_config = GenerationConfig.from_model_config(hf.config)
    hf.generation_config.eos_token_id = None  # the config's eos id 0 would otherwise end hypotheses
    return hf


class HuggingFaceBackend(EagerAtPositions):
    """The eager reference's memory of hidden states (its state, saved as it saves it) run through HuggingFace's
    model, whose memory is the same hidden states, time-major."""

    name = "transformers"

    def _prepare(self):
        self.hf = to_huggingface(self.model)

    def _body(self, tokens, mems):
        with transformers_on_current_torch():
            out = self.hf.transformer(input_ids=tokens, mems=[m.transpose(0, 1) for m in mems])
        return out.last_hidden_state, [m.transpose(0, 1) for m in out.mems]

    def _output_layer(self, hidden):
        return self.hf.crit(hidden).view(*hidden.shape[:-1], -1)
