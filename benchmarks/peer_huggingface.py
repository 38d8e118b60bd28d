"""HuggingFace transformers' TransfoXL generating with its mems: what a PyTorch user would try first.

A peer in the benchmark, not a runtime of the project (transformers is in the test extra; its TransfoXL is
deprecated, and deleted in transformers 5.0). The model is built from the same weights as every other side:
our parameter names mapped onto HuggingFace's (the inverse of the import in `checkpoints/huggingface.py`), with
the cluster trap handled: HuggingFace reads tail cluster i's logit from head column `cutoffs[0] + i - 1`, ours
(like the original code) from column `-i`, so the rows of `crit.cluster_weight` / `crit.cluster_bias` are
reversed (`reverse_rows`, its own inverse). The ties are ours, pattern for pattern (`config.tie_projs`).

The memory starts explicitly empty (n_layer tensors of length 0): HuggingFace fed that behaves as the paper and
txl-deploy do from the first token on; left to `init_mems` it would attend to mem_len zero vectors until they
scroll out. A decode step is `model(input_ids=tokens, mems=mems)` and keeps `.mems` and `.prediction_scores`,
as a user's generation loop does; longer inputs (the memory's fill) run the model body and the output layer at
the requested positions only.

The deprecated model calls `torch.arange(...).type_as(dtype=...)`, which current torch no longer accepts; each
call runs with `Tensor.type_as` taking that keyword as `.to(dtype)`, and puts the original back afterwards.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.huggingface import reverse_rows
from txl_deploy.checkpoints.keymap import Rule, rename
from txl_deploy.errors import InputError
from txl_deploy.runtimes.backend import Backend

# our name -> HuggingFace's (the inverse of checkpoints/huggingface.py's HF_RULES)
TO_HF_RULES = [
    Rule(r"word_emb\.emb_layers\.(\d+)\.weight", r"transformer.word_emb.emb_layers.\1.weight"),
    Rule(r"word_emb\.emb_projs\.(\d+)", r"transformer.word_emb.emb_projs.\1"),
    Rule(r"layers\.(\d+)\.dec_attn\.(qkv_net|o_net|r_net)\.weight", r"transformer.layers.\1.dec_attn.\2.weight"),
    Rule(r"layers\.(\d+)\.dec_attn\.layer_norm\.(weight|bias)", r"transformer.layers.\1.dec_attn.layer_norm.\2"),
    Rule(r"layers\.(\d+)\.dec_attn\.(r_w_bias|r_r_bias)", r"transformer.layers.\1.dec_attn.\2"),
    Rule(r"layers\.(\d+)\.pos_ff\.CoreNet\.(0|3)\.(weight|bias)", r"transformer.layers.\1.pos_ff.CoreNet.\2.\3"),
    Rule(r"layers\.(\d+)\.pos_ff\.layer_norm\.(weight|bias)", r"transformer.layers.\1.pos_ff.layer_norm.\2"),
    Rule(r"(r_w_bias|r_r_bias)", r"transformer.\1"),
    Rule(r"pos_emb\.inv_freq", r"transformer.pos_emb.inv_freq"),
    Rule(r"crit\.(cluster_weight|cluster_bias)", r"crit.\1", reverse_rows),
    Rule(r"crit\.out_layers\.(\d+)\.(weight|bias)", r"crit.out_layers.\1.\2"),
    Rule(r"crit\.out_projs\.(\d+)", r"crit.out_projs.\1"),
]


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

    # Saved, the memory has a fixed layout like the other backends' (runtimes.saved_state reads nothing else):
    # "lens" [B] (its filled length, one for all rows) and "mems.i" [B, mem_len, d_model], filled from the start.
    def state_layout(self, batch):
        layout = {"lens": ((batch,), np.dtype(np.int64))}
        for i in range(self.config.n_layer):
            layout[f"mems.{i}"] = ((batch, self.mem_len, self.config.d_model), np.dtype(np.float32))
        return layout

    def state_arrays(self, state) -> dict:
        mlen, batch = state["mems"][0].shape[:2]
        arrays = {"lens": np.full(batch, mlen, np.int64)}
        for i, m in enumerate(state["mems"]):
            padded = np.zeros((batch, self.mem_len, self.config.d_model), np.float32)
            padded[:, :mlen] = m.numpy().transpose(1, 0, 2)
            arrays[f"mems.{i}"] = padded
        return arrays

    def state_from_arrays(self, arrays, copy=True):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        if set(arrays) != set(self.state_layout(1)):
            raise InputError("this state does not belong to this model (its tensors differ)")
        lens = np.asarray(arrays["lens"])
        batch = lens.shape[0] if lens.ndim == 1 else -1
        for name, (shape, dtype) in self.state_layout(max(batch, 0)).items():
            a = np.asarray(arrays[name])
            if batch < 0 or a.shape != shape or a.dtype != dtype:
                raise InputError(f"state tensor {name} has shape {a.shape} {a.dtype}, this model needs {shape} "
                                 f"{dtype.name}")
        if batch and (lens.min() != lens.max() or not 0 <= lens[0] <= self.mem_len):
            raise InputError(f"the HuggingFace peer keeps one memory length (0..{self.mem_len}) for all rows, "
                             f"got {sorted(set(lens.tolist()))[:4]}")
        mlen = int(lens[0]) if batch else 0
        time_major = (np.asarray(arrays[f"mems.{i}"])[:, :mlen].transpose(1, 0, 2) for i in range(self.config.n_layer))
        return {"mems": [torch.from_numpy(np.ascontiguousarray(m)) for m in time_major]}
