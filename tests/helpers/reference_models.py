"""The small Transformer-XL the checkpoint parity tests share, with HuggingFace's TransfoXL as the reference.

HuggingFace's TransfoXL (transformers' deprecated `TransfoXLLMHeadModel`; the `hf` fixture in tests/conftest.py
gives its module, or skips) is an implementation independent of ours. `build_hf_from` makes a random HF model that
computes what an original model with the given constructor arguments computes; `original_state` converts its
weights to the original names (`original_checkpoints.hf_to_original`), from which the CMU and NVIDIA files are
written. Our own model is built by `make_our_model` and written in the original layout by
`save_our_model_as_model_pt` (it keeps the original parameter names).

NVIDIA's same_length window (one key longer than the original's) does not exist in HuggingFace: its log-probs
come from HuggingFace run with a window one longer (mem_len + 1) whose returned memory is cut back to mem_len after
every segment (`run_hf(..., window_extra=1)`), which is exactly NVIDIA's published formula
(`mask_len = klen - mem_len - 1` in their mem_transformer.py).

Every parity test runs >= 4 consecutive segments (`tokens`) with the memory threaded, batch 3, fp32, and compares
full log-probabilities to TOL.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from helpers import original_checkpoints as oc

V, N_LAYER, N_HEAD, D_HEAD, D_MODEL, D_INNER = 40, 2, 2, 8, 16, 32
Q, MEM_LEN, CLAMP_LEN, BATCH, SEGMENTS = 5, 7, 4, 3, 6
TOL = 1e-5
WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(V - 2)]


# -- random weights and streams --------------------------------------------------------------------------
def randomize(module, seed):
    """Random weights everywhere (the sources leave many parameters uninitialised or at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.1 if "layer_norm" in name else 0.15
            base = 1.0 if name.endswith("layer_norm.weight") else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    return module.eval()


def tokens(seed=0, segments=SEGMENTS):
    return torch.randint(0, V, (BATCH, Q * segments), generator=torch.Generator().manual_seed(seed))


def run_ours(model, ids):
    """Log-probs [B, Q, V] per segment from our model, memory threaded."""
    out, mems = [], None
    with torch.no_grad():
        for s in range(ids.shape[1] // Q):
            lp, mems = model(ids[:, s * Q:(s + 1) * Q], mems)
            out.append(lp)
    return out, mems


def max_diff(a_list, b_list):
    return [float((a - b).abs().max()) for a, b in zip(a_list, b_list)]


def write_vocab_txt(folder):
    (Path(folder) / "vocab.txt").write_text("".join(f"{w}\n" for w in WORDS))



def original_kwargs(**changes):
    """The original MemTransformerLM constructor's keyword arguments (NVIDIA's model_config has the same)."""
    hp = dict(n_token=V, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, d_head=D_HEAD, d_inner=D_INNER,
              dropout=0.0, dropatt=0.0, tie_weight=True, d_embed=D_MODEL, div_val=1, tie_projs=[False],
              pre_lnorm=False, tgt_len=Q, ext_len=0, mem_len=MEM_LEN, cutoffs=[], same_length=False, attn_type=0,
              clamp_len=CLAMP_LEN)
    hp.update(changes)
    hp["tie_projs"] = (list(hp["tie_projs"]) + [False] * len(hp["cutoffs"]))[: len(hp["cutoffs"]) + 1]
    return hp


def build_hf_from(transfo, hp, untie_r=False, seed=4):
    """A random HuggingFace model computing what an original model with constructor arguments `hp` computes.

    HF ties projections only in the pattern [False, True, True, ...] (`proj_share_all_but_first`); other patterns
    are built untied and given equal values, which computes the same.
    """
    share = hp["tie_projs"][0] is False and len(hp["tie_projs"]) > 1 and all(hp["tie_projs"][1:])
    cfg = transfo.TransfoXLConfig(
        vocab_size=hp["n_token"], cutoffs=list(hp["cutoffs"]), d_model=hp["d_model"], d_embed=hp["d_embed"],
        n_head=hp["n_head"], d_head=hp["d_head"], d_inner=hp["d_inner"], div_val=hp["div_val"],
        n_layer=hp["n_layer"], mem_len=hp["mem_len"], clamp_len=hp["clamp_len"], same_length=hp["same_length"],
        pre_lnorm=hp["pre_lnorm"], untie_r=untie_r, proj_share_all_but_first=share, dropout=0.0, dropatt=0.0,
        tie_word_embeddings=hp["tie_weight"])
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = randomize(transfo.TransfoXLLMHeadModel(cfg), seed)
    if not share:
        with torch.no_grad():
            for i in range(len(hp["tie_projs"])):
                source = oc.tied_proj_source(hp, i)
                if source is not None:
                    j = int(source.rsplit(".", 1)[1])
                    model.crit.out_projs[i].copy_(model.transformer.word_emb.emb_projs[j])
    return model


def build_hf(transfo, untie_r, same_length, tie_word_embeddings=True, d_embed=16, seed=4):
    hp = original_kwargs(d_embed=d_embed, div_val=2, cutoffs=[10, 25], tie_projs=[False, True, True],
                         same_length=same_length, tie_weight=tie_word_embeddings)
    return build_hf_from(transfo, hp, untie_r=untie_r, seed=seed)


def run_hf(model, ids, mems, window_extra=0):
    """HF's log-probs per segment and its last memory. `window_extra`: run HF with mem_len + window_extra (its
    same_length window grows with it) and cut the memory it returns back to mem_len after every segment."""
    mem_len = model.transformer.mem_len
    model.transformer.mem_len = mem_len + window_extra
    out = []
    try:
        with torch.no_grad():
            for s in range(ids.shape[1] // Q):
                result = model(input_ids=ids[:, s * Q:(s + 1) * Q], mems=mems)
                out.append(result.prediction_scores)
                mems = [m[-mem_len:] for m in result.mems]
    finally:
        model.transformer.mem_len = mem_len
    return out, mems


def empty_mems():
    # HF fed an explicitly empty memory behaves as the paper (and we) do from the first segment on.
    return [torch.zeros(0, BATCH, D_MODEL) for _ in range(N_LAYER)]


def original_state(model, untie_r=False, dtype=None):
    state = oc.hf_to_original(model.state_dict(), untie_r)
    return {k: v.to(dtype) for k, v in state.items()} if dtype is not None else state


def assert_mems_match(ours, theirs):
    # HF caches n_layer + 1 time-major tensors (the input of every layer, then the output); the first n_layer
    # are ours.
    assert max(float((m - r.transpose(0, 1)).abs().max()) for m, r in zip(ours, theirs)) <= TOL


# -- original CMU code -------------------------------------------------------------------------------------
CMU_VARIANTS = {
    # adaptive input/softmax with div_val 2, projections tied for the tail clusters
    "div2": dict(d_embed=16, div_val=2, cutoffs=[10, 25], tie_projs=[False, True, True], same_length=False),
    # d_embed != d_model, untied output layer, same_length, pre-LayerNorm
    "div2-untied-same-pre": dict(d_embed=32, div_val=2, cutoffs=[10, 25], tie_weight=False,
                                 tie_projs=[False, False, True], same_length=True, pre_lnorm=True),
    # div_val 1 with a projection (d_embed != d_model): one output layer sliced per cluster
    "div1-proj-same": dict(d_embed=24, div_val=1, cutoffs=[10, 25], tie_projs=[False, True, True],
                           same_length=True),
    # a character-level model: no clusters, plain softmax
    "char": dict(cutoffs=[], same_length=False),
}


# -- NVIDIA DeepLearningExamples -------------------------------------------------------------------------
NVIDIA_VARIANTS = {
    "div2-same": dict(d_embed=16, div_val=2, cutoffs=[10, 25], tie_projs=[False, True, True], same_length=True),
    "div2-untied": dict(d_embed=32, div_val=2, cutoffs=[10, 25], tie_weight=False, tie_projs=[False, False, True],
                        same_length=False),
    "div1-proj-same": dict(d_embed=24, div_val=1, cutoffs=[10, 25], tie_projs=[False, False, True],
                           same_length=True, pre_lnorm=True),
}


def make_nvidia_checkpoint(transfo, variant, path, seed=3, dtype=None):
    """An NVIDIA checkpoint from a random HF model; returns (hf model, hp)."""
    hp = original_kwargs(**NVIDIA_VARIANTS[variant])
    model = build_hf_from(transfo, hp, seed=seed)
    oc.save_nvidia_checkpoint(path, original_state(model, dtype=dtype), hp, WORDS)
    return model, hp


def nvidia_reference(model, hp, ids):
    """HF's log-probs with NVIDIA's same_length window (see the module docstring)."""
    return run_hf(model, ids, empty_mems(), window_extra=1 if hp["same_length"] else 0)


# -- checkpoints of our own model written in the original layouts (no reference needed) ----------------------
def make_our_model(seed=1, **changes):
    from txl_deploy.config import TxlConfig
    from txl_deploy.model.mem_transformer import MemTransformerLM

    cfg = dict(n_token=V, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, d_head=D_HEAD, d_inner=D_INNER,
               tgt_len=Q, mem_len=MEM_LEN, clamp_len=CLAMP_LEN)
    cfg.update(changes)
    torch.manual_seed(seed)
    return randomize(MemTransformerLM(TxlConfig(**cfg)), seed)


def kwargs_of(cfg):
    """The original constructor arguments of one of our configs."""
    return original_kwargs(**{k: getattr(cfg, k) for k in ("n_token", "n_layer", "n_head", "d_model", "d_head",
                                                           "d_inner", "d_embed", "div_val", "cutoffs", "tie_weight",
                                                           "tie_projs", "pre_lnorm", "tgt_len", "mem_len",
                                                           "clamp_len", "same_length")})


def save_our_model_as_model_pt(path, extra_attrs=None, **changes):
    """Our model keeps the original parameter names, so its state_dict is an original one as it stands."""
    model = make_our_model(**changes)
    oc.save_original_model_pt(path, model.state_dict(), kwargs_of(model.cfg), extra_attrs=extra_attrs)
    return model
