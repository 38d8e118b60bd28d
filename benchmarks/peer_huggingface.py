"""HuggingFace transformers' TransfoXL generating with its mems: what a PyTorch user would try first. A peer in the
benchmark, not a runtime of the project: built from the same weights as every other side (`checkpoints/
huggingface.py`'s rules inverted), its memory started empty as the paper's. How it is driven: docs/benchmarks.md
("Peers")."""

from __future__ import annotations

import contextlib
import re
import warnings

import numpy as np

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.huggingface import HF_RULES
from txl_deploy.checkpoints.keymap import Rule, rename
from txl_deploy.errors import InputError
from txl_deploy.runtimes.backend import Backend

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
    with torch.no_grad():
        missing, unexpected = hf.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(f"the HuggingFace model does not take these weights (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    return hf


class HuggingFaceBackend(Backend):
    """State: {"mems": n_layer tensors [mlen, B, d_model]} (HuggingFace's time-major memory of hidden states)."""

    name = "transformers"

    @classmethod
    def from_checkpoint(cls, path, mem_len: int | None = None, max_segment: int = 512, threads: int | None = None):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        from txl_deploy.model.weights import build_model  # imports torch

        if threads:
            torch.set_num_threads(int(threads))  # process-wide: PyTorch has no per-model thread pool
        self = cls()
        loaded = load_model(path)
        model = build_model(loaded.config, loaded.state_dict, loaded.path)
        if mem_len:
            model.reset_length(mem_len)
        self.config, self.vocab, self.mem_len = model.cfg, loaded.vocab, model.cfg.mem_len
        self.max_segment, self.threads = int(max_segment), threads
        self.model = to_huggingface(model)
        del model
        return self

    def fingerprint(self) -> str:
        return f"transformers-{self.config.n_layer}x{self.config.d_model}-m{self.mem_len}"

    def new_state(self, batch: int):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        return {"mems": [torch.zeros(0, batch, self.config.d_model) for _ in range(self.config.n_layer)]}

    def state_batch(self, state) -> int:
        return state["mems"][0].shape[1]

    def run(self, state, tokens, out_positions):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        x, idx = torch.from_numpy(np.array(tokens)), torch.from_numpy(np.array(out_positions))
        with torch.no_grad(), transformers_on_current_torch():
            if tokens.shape[1] == 1 and out_positions.shape[1] == 1:
                out = self.model(input_ids=x, mems=state["mems"])
                log_probs, mems = out.prediction_scores, out.mems
            else:
                out = self.model.transformer(input_ids=x, mems=state["mems"])
                hidden = out.last_hidden_state.gather(1, idx[:, :, None].expand(-1, -1, self.config.d_model))
                log_probs = self.model.crit(hidden).view(*idx.shape, -1)
                mems = out.mems
        state["mems"] = mems  # only once the call succeeded
        return log_probs.float().numpy()

    def reset_rows(self, state, rows):
        if len(set(int(r) for r in rows)) != self.state_batch(state):
            raise InputError("the HuggingFace peer keeps one memory length for all rows: reset all of them")
        state.update(self.new_state(self.state_batch(state)))

    # Saved: "mem_count" [B] (the filled length, one for all rows) and "mems.i" [B, mem_len, d_model] from the start.
    def state_layout(self, batch):
        layout = {"mem_count": ((batch,), np.dtype(np.int64))}
        for i in range(self.config.n_layer):
            layout[f"mems.{i}"] = ((batch, self.mem_len, self.config.d_model), np.dtype(np.float32))
        return layout

    def state_arrays(self, state) -> dict:
        mlen, batch = state["mems"][0].shape[:2]
        arrays = {"mem_count": np.full(batch, mlen, np.int64)}
        for i, m in enumerate(state["mems"]):
            padded = np.zeros((batch, self.mem_len, self.config.d_model), np.float32)
            padded[:, :mlen] = m.numpy().transpose(1, 0, 2)
            arrays[f"mems.{i}"] = padded
        return arrays

    def state_from_arrays(self, arrays, copy=True):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        _, arrays = self.checked_arrays(arrays, copy)
        lens = arrays["mem_count"]
        if lens.size and not (lens.min() == lens.max() and 0 <= lens[0] <= self.mem_len):
            raise InputError(f"the HuggingFace peer keeps one memory length (0..{self.mem_len}) for all rows")
        mlen = int(lens[0]) if lens.size else 0
        return {"mems": [torch.from_numpy(np.ascontiguousarray(np.asarray(arrays[f"mems.{i}"])[:, :mlen]
                                                               .transpose(1, 0, 2))) for i in range(self.config.n_layer)]}
