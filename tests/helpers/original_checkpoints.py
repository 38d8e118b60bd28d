"""Checkpoint files in the layouts the original trainers write, built from tensors and names alone.

A checkpoint file holds data, not behaviour, so a fixture needs only what the files carry:

- The original CMU `model.pt` (kimiyoung/transformer-xl, `torch.save(model)`) pickles each module as the qualified
  name of its class plus its `__dict__`: hyper-parameters as attributes, `_parameters`, `_buffers`, `_modules`.
  `original_module_tree` rebuilds that tree from torch.nn containers and layers, with the Transformer-XL modules as
  classes of the original qualified names (`mem_transformer.MemTransformerLM`,
  `proj_adaptive_softmax.ProjectedAdaptiveLogSoftmax`, ...) that have no code at all. They exist in `sys.modules`
  only while the file is written (`original_modules`), so the loader under test cannot import them.
- NVIDIA DeepLearningExamples' `checkpoint_best.pt` is a dict (`train.py:save_checkpoint`): `model_config`,
  `model_state` in their parameter names, an `argparse.Namespace` under `args`, their
  `utils.vocabulary.Vocab` object under `vocab`, optimizer and scheduler state.

The attribute names, class names and state-dict keys below are facts about those files (as read in the public
sources); none of the original code is here. The weights come from HuggingFace's TransfoXL (`hf_to_original`
converts its state_dict to the original names) or from our own model, which already uses the original names.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import sys
import types

import torch
from torch import nn

# The classes an original `model.pt` names, by the module it pickles them under (the original puts utils/ on
# sys.path, so its output layer pickles as `proj_adaptive_softmax.X`). NVIDIA's vocabulary is `utils.vocabulary.Vocab`.
ORIGINAL_CLASSES = {
    "mem_transformer": ["MemTransformerLM", "AdaptiveEmbedding", "PositionalEmbedding",
                        "RelPartialLearnableDecoderLayer", "RelPartialLearnableMultiHeadAttn", "PositionwiseFF"],
    "proj_adaptive_softmax": ["ProjectedAdaptiveLogSoftmax"],
    "utils": [],
    "utils.vocabulary": ["Vocab"],
}


@contextlib.contextmanager
def original_modules():
    """Modules of the original names holding classes without code, registered for the time a file is written."""
    made, saved = {}, {}
    for name, classes in ORIGINAL_CLASSES.items():
        saved[name] = sys.modules.pop(name, None)
        module = types.ModuleType(name)
        base = object if name.startswith("utils") else nn.Module
        for cls in classes:
            setattr(module, cls, type(cls, (base,), {"__module__": name, "__qualname__": cls}))
        made[name] = sys.modules[name] = module
    made["utils"].vocabulary = made["utils.vocabulary"]
    try:
        yield types.SimpleNamespace(**{cls: getattr(made[m], cls) for m, cs in ORIGINAL_CLASSES.items() for cls in cs})
    finally:
        for name in ORIGINAL_CLASSES:
            del sys.modules[name]
            if saved[name] is not None:
                sys.modules[name] = saved[name]


# -- HuggingFace -> original names ---------------------------------------------------------------------------
def hf_to_original(hf_state: dict, untie_r: bool) -> dict:
    """A HuggingFace TransfoXLLMHeadModel state_dict in the original code's names and cluster order."""
    out = {}
    for key, t in hf_state.items():
        if key.startswith("transformer."):
            key = key[len("transformer."):]
        if key in ("crit.cluster_weight", "crit.cluster_bias"):
            # HF reads tail cluster i's logit from head column cutoffs[0] + i - 1, the original from column -i.
            t = t.flip(0)
        if not untie_r and re.fullmatch(r"layers\.\d+\.dec_attn\.r_[wr]_bias", key):
            continue  # HF registers the shared pair in every layer as well; the original holds it once
        out[key] = t.detach().clone()
    return out


def n_out(hp) -> int:
    return 1 if hp["div_val"] == 1 else len(hp["cutoffs"]) + 1


def tied_proj_source(hp, i):
    """The embedding projection crit.out_projs.i is tied to, or None (the original constructor's rule)."""
    if not hp["tie_projs"][i]:
        return None
    if hp["div_val"] == 1:
        return "word_emb.emb_projs.0" if hp["d_model"] != hp["d_embed"] else None
    return f"word_emb.emb_projs.{i}"


# -- the original model.pt -----------------------------------------------------------------------------------
def original_module_tree(C, state: dict, hp: dict):
    """The object tree `torch.save(model)` writes for the original MemTransformerLM, with `state`'s tensors.

    `C`: the classes from `original_modules()`; `hp`: the original constructor's keyword arguments. Tied
    parameters are one Parameter object under both names, as the original's tying leaves them.
    """
    params: dict = {}

    def param(key):
        if key not in params:
            params[key] = nn.Parameter(state[key], requires_grad=False)
        return params[key]

    def linear(prefix, bias):
        w = state[prefix + ".weight"]
        layer = nn.Linear(w.shape[1], w.shape[0], bias=bias, device="meta")
        layer.weight = param(prefix + ".weight")
        if bias:
            layer.bias = param(prefix + ".bias")
        return layer

    def layer_norm(prefix):
        ln = nn.LayerNorm(state[prefix + ".weight"].shape[0], eps=hp.get("layer_norm_epsilon", 1e-5), device="meta")
        ln.weight, ln.bias = param(prefix + ".weight"), param(prefix + ".bias")
        return ln

    def embedding(key):
        emb = nn.Embedding(*state[key].shape, device="meta")
        emb.weight = param(key)
        return emb

    d_model, d_embed, n_token, cutoffs = hp["d_model"], hp["d_embed"], hp["n_token"], list(hp["cutoffs"])
    ends = [0] + cutoffs + [n_token]

    word_emb = C.AdaptiveEmbedding()
    word_emb.__dict__.update(n_token=n_token, d_embed=d_embed, cutoffs=cutoffs + [n_token], div_val=hp["div_val"],
                             d_proj=d_model, emb_scale=d_model ** 0.5, cutoff_ends=ends)
    word_emb.emb_layers = nn.ModuleList(embedding(f"word_emb.emb_layers.{i}.weight") for i in range(n_out(hp)))
    word_emb.emb_projs = nn.ParameterList()
    for i in range(n_out(hp)):
        if f"word_emb.emb_projs.{i}" in state:
            word_emb.emb_projs.append(param(f"word_emb.emb_projs.{i}"))

    layers = nn.ModuleList()
    for n in range(hp["n_layer"]):
        p = f"layers.{n}."
        attn = C.RelPartialLearnableMultiHeadAttn()
        attn.__dict__.update(n_head=hp["n_head"], d_model=d_model, d_head=hp["d_head"], dropout=hp["dropout"],
                             scale=1 / hp["d_head"] ** 0.5, pre_lnorm=hp["pre_lnorm"])
        attn.qkv_net = linear(p + "dec_attn.qkv_net", bias=False)
        attn.drop, attn.dropatt = nn.Dropout(hp["dropout"]), nn.Dropout(hp["dropatt"])
        attn.o_net = linear(p + "dec_attn.o_net", bias=False)
        attn.layer_norm = layer_norm(p + "dec_attn.layer_norm")
        attn.r_net = linear(p + "dec_attn.r_net", bias=False)
        if p + "dec_attn.r_w_bias" in state:  # forks that untie_r keep one pair per layer
            attn.r_w_bias, attn.r_r_bias = param(p + "dec_attn.r_w_bias"), param(p + "dec_attn.r_r_bias")
        ff = C.PositionwiseFF()
        ff.__dict__.update(d_model=d_model, d_inner=hp["d_inner"], dropout=hp["dropout"], pre_lnorm=hp["pre_lnorm"])
        ff.CoreNet = nn.Sequential(linear(p + "pos_ff.CoreNet.0", bias=True), nn.ReLU(inplace=True),
                                   nn.Dropout(hp["dropout"]), linear(p + "pos_ff.CoreNet.3", bias=True),
                                   nn.Dropout(hp["dropout"]))
        ff.layer_norm = layer_norm(p + "pos_ff.layer_norm")
        layer = C.RelPartialLearnableDecoderLayer()
        layer.dec_attn, layer.pos_ff = attn, ff
        layers.append(layer)

    crit = C.ProjectedAdaptiveLogSoftmax()
    crit.__dict__.update(n_token=n_token, d_embed=d_embed, d_proj=d_model, cutoffs=cutoffs + [n_token],
                         cutoff_ends=ends, div_val=hp["div_val"], shortlist_size=ends[1], n_clusters=len(cutoffs),
                         head_size=ends[1] + len(cutoffs), keep_order=False)
    if cutoffs:
        crit.cluster_weight, crit.cluster_bias = param("crit.cluster_weight"), param("crit.cluster_bias")
    crit.out_layers = nn.ModuleList()
    for i in range(n_out(hp)):
        layer = linear(f"crit.out_layers.{i}", bias=True)
        if hp["tie_weight"]:
            layer.weight = param(f"word_emb.emb_layers.{i}.weight")
        crit.out_layers.append(layer)
    crit.out_projs = nn.ParameterList()
    for i in range(len(cutoffs) + 1):
        source = tied_proj_source(hp, i)
        if source is not None:
            crit.out_projs.append(param(source))
        elif f"crit.out_projs.{i}" in state:
            crit.out_projs.append(param(f"crit.out_projs.{i}"))
        else:  # d_proj == d_embed: the original appends None
            crit.out_projs.register_parameter(str(i), None)

    pos_emb = C.PositionalEmbedding()
    pos_emb.demb = d_model
    pos_emb.register_buffer("inv_freq", state["pos_emb.inv_freq"])

    root = C.MemTransformerLM()
    root.__dict__.update(
        n_token=n_token, d_embed=d_embed, d_model=d_model, n_head=hp["n_head"], d_head=hp["d_head"],
        n_layer=hp["n_layer"], tgt_len=hp["tgt_len"], mem_len=hp["mem_len"], ext_len=hp.get("ext_len", 0),
        max_klen=hp["tgt_len"] + hp.get("ext_len", 0) + hp["mem_len"], attn_type=hp.get("attn_type", 0),
        sample_softmax=-1, same_length=hp["same_length"], clamp_len=hp["clamp_len"])
    root.word_emb, root.drop, root.layers, root.crit, root.pos_emb = (
        word_emb, nn.Dropout(hp["dropout"]), layers, crit, pos_emb)
    if "r_w_bias" in state:
        root.r_w_bias, root.r_r_bias = param("r_w_bias"), param("r_r_bias")
    return root


def save_original_model_pt(path, state: dict, hp: dict, legacy: bool = False, extra_attrs: dict | None = None):
    """Write `path` as the original train.py does (`torch.save(model)`); `legacy`: the pre-1.6 serialisation
    the published checkpoints were written with. `extra_attrs` go onto the root module."""
    import warnings

    with original_modules() as C:
        root = original_module_tree(C, state, hp)
        root.__dict__.update(extra_attrs or {})
        with warnings.catch_warnings():
            # The legacy format looks for each module class's source, and these classes have none.
            warnings.simplefilter("ignore")
            torch.save(root, path, _use_new_zipfile_serialization=not legacy)


# -- NVIDIA DeepLearningExamples -----------------------------------------------------------------------------
def nvidia_model_state(state: dict, hp: dict) -> dict:
    """Original names -> NVIDIA's: the output layer as `out_layers_weights.N` (absent when tied) and
    `out_layers_biases.N`, untied projections as `out_projs.N`, and the embedding's projections registered a
    second time as `shared_out_projs.N` (the same tensors)."""
    out = collections.OrderedDict()
    for key, t in state.items():
        m = re.fullmatch(r"crit\.out_layers\.(\d+)\.(weight|bias)", key)
        if m and m.group(2) == "weight":
            if not hp["tie_weight"]:
                out[f"crit.out_layers_weights.{m.group(1)}"] = t
        elif m:
            out[f"crit.out_layers_biases.{m.group(1)}"] = t
        elif re.fullmatch(r"crit\.out_projs\.(\d+)", key):
            if not hp["tie_projs"][int(key.rsplit(".", 1)[1])]:
                out[key] = t
        else:
            out[key] = t
    for key in [k for k in out if k.startswith("word_emb.emb_projs.")]:
        out["crit.shared_out_projs." + key.rsplit(".", 1)[1]] = out[key]
    return out


def nvidia_vocab(C, symbols):
    """Their `utils.vocabulary.Vocab` as pickled: counter, special, ..., idx2sym and sym2idx."""
    vocab = C.Vocab()
    vocab.__dict__.update(
        counter=collections.Counter({s: len(symbols) - i for i, s in enumerate(symbols)}), special=["<eos>"],
        min_freq=0, max_size=None, lower_case=False, delimiter=None, vocab_file=None, idx2sym=list(symbols),
        sym2idx=collections.OrderedDict((s, i) for i, s in enumerate(symbols)))
    vocab.unk_idx = vocab.sym2idx.get("<unk>", 0)
    return vocab


def save_nvidia_checkpoint(path, state: dict, hp: dict, symbols, fp16: bool = False):
    """Write `path` as NVIDIA's train.py:save_checkpoint does. `state`: original names; `hp`: model_config."""
    model_state = nvidia_model_state(state, hp)
    model_config = dict(hp, dtype=None, sample_softmax=-1)
    with original_modules() as C:
        checkpoint = {
            "args": argparse.Namespace(dataset="wt103", n_layer=hp["n_layer"], d_model=hp["d_model"], fp16=fp16,
                                       work_dir="LM-TFM", mem_len=hp["mem_len"], same_length=hp["same_length"]),
            "model_config": model_config,
            "model_state": model_state,
            "optimizer_state": {"state": {0: {"step": 3, "exp_avg": torch.zeros(2)}},
                                "param_groups": [{"lr": 0.01, "params": [0]}]},
            "scheduler_state": {"T_max": 100, "eta_min": 0.001, "base_lrs": [0.01], "last_epoch": 3},
            "vocab": nvidia_vocab(C, symbols),
            "amp_state": None,
            "epoch": 1,
            "batch": 3,
            "last_iter": 3,
            "train_step": 3,
            "best_val_loss": 4.25,
        }
        torch.save(checkpoint, path)
    return model_state
