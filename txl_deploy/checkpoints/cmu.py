"""The original CMU PyTorch code (kimiyoung/transformer-xl, `pytorch/mem_transformer.py`).

Two shapes of checkpoint:
- `model.pt`, `torch.save(model)` of the whole `mem_transformer.MemTransformerLM`. It is read with the restricted
  unpickler (`torch_files`): the modules come back as inert attribute holders; the hyper-parameters are their
  pickled attributes and the weights their `_parameters` / `_modules`.
- a bare state_dict (`torch.save(model.state_dict())` or a `.safetensors` file with the same names) plus a JSON
  config (see `config_from_kwargs` and `find_config`).

Our model keeps the original parameter names, so the table below is nearly the identity; it exists to refuse
foreign keys. The positional `inv_freq` buffer is kept as stored: a checkpoint saved in fp16 holds it rounded, and
the model was trained and evaluated with the rounded values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from txl_deploy.checkpoints.keymap import Rule, infer_ties, normalise, rename, strip_prefix
from txl_deploy.checkpoints.native import LoadedModel, read_json_object
from txl_deploy.checkpoints.reader import Reader, Source
from txl_deploy.checkpoints.torch_files import module_tree_state_dict, submodule
from txl_deploy.checkpoints.unpickler import attr, pickled_class
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError, TxlError

CMU_RULES = [
    Rule(r"word_emb\.emb_layers\.(\d+)\.weight", r"word_emb.emb_layers.\1.weight"),
    Rule(r"word_emb\.emb_projs\.(\d+)", r"word_emb.emb_projs.\1"),
    Rule(r"layers\.(\d+)\.dec_attn\.(qkv_net|o_net|r_net)\.weight", r"layers.\1.dec_attn.\2.weight"),
    Rule(r"layers\.(\d+)\.dec_attn\.layer_norm\.(weight|bias)", r"layers.\1.dec_attn.layer_norm.\2"),
    Rule(r"layers\.(\d+)\.dec_attn\.(r_w_bias|r_r_bias)", r"layers.\1.dec_attn.\2"),  # forks that untie_r
    Rule(r"layers\.(\d+)\.pos_ff\.CoreNet\.(0|3)\.(weight|bias)", r"layers.\1.pos_ff.CoreNet.\2.\3"),
    Rule(r"layers\.(\d+)\.pos_ff\.layer_norm\.(weight|bias)", r"layers.\1.pos_ff.layer_norm.\2"),
    Rule(r"(r_w_bias|r_r_bias)", r"\1"),
    Rule(r"crit\.(cluster_weight|cluster_bias)", r"crit.\1"),  # cluster i at head column -i, as ours
    Rule(r"crit\.out_layers\.(\d+)\.(weight|bias)", r"crit.out_layers.\1.\2"),
    Rule(r"crit\.out_projs\.(\d+)", r"crit.out_projs.\1"),
    Rule(r"pos_emb\.inv_freq", r"pos_emb.inv_freq"),  # used as stored (rounded when saved in fp16)
]

MODEL_CLASS = "mem_transformer.MemTransformerLM"
_WRAPPERS = ("torch.nn.parallel.data_parallel.DataParallel",
             "torch.nn.parallel.distributed.DistributedDataParallel")

# Constructor arguments of the original MemTransformerLM (and NVIDIA's, which adds `dtype`) that only matter
# for training or select code paths we check separately.
TRAINING_ONLY = {"dropout", "dropatt", "dtype", "adapt_inp", "ext_len"}
CONFIG_FIELDS = {f.name for f in dataclasses.fields(TxlConfig)}


REQUIRED_FIELDS = [f.name for f in dataclasses.fields(TxlConfig)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _config(fields: dict, path) -> TxlConfig:
    missing = [name for name in REQUIRED_FIELDS if name not in fields]
    if missing:
        raise CheckpointError(path, f"config lacks {', '.join(missing)}")
    try:
        return TxlConfig(**fields)
    except TxlError as e:
        raise CheckpointError(path, str(e)) from None
    except TypeError as e:
        raise CheckpointError(path, f"incomplete config ({e})") from None


def check_supported(attn_type, sample_softmax, path):
    if int(attn_type if attn_type is not None else 0) != 0:
        raise CheckpointError(path, f"attn_type {attn_type} is not supported (only 0, the relative attention "
                                    "every published model uses)")
    if sample_softmax is not None and int(sample_softmax) > 0:
        raise CheckpointError(path, "sample_softmax > 0 (sampled softmax) is not supported: such a model has no "
                                    "adaptive softmax to evaluate")


def config_fields_from_kwargs(kwargs: dict, path, source: str) -> dict:
    """TxlConfig fields from the original constructor's keyword arguments (also NVIDIA's `model_config`).

    Our own TxlConfig names (`untie_r`, `layer_norm_epsilon`, `same_length_extra`) are accepted too; anything
    else is an error naming the keys, so a typo does not silently fall back to a default.
    """
    if not isinstance(kwargs, dict):
        raise CheckpointError(path, f"{source} config is a {type(kwargs).__name__}, not a mapping")
    unknown = sorted(set(kwargs) - CONFIG_FIELDS - TRAINING_ONLY - {"attn_type", "sample_softmax"})
    if unknown:
        raise CheckpointError(path, f"unknown {source} config keys: {', '.join(unknown)}")
    check_supported(kwargs.get("attn_type"), kwargs.get("sample_softmax"), path)
    fields = {k: v for k, v in kwargs.items() if k in CONFIG_FIELDS and v is not None}
    fields.setdefault("tie_weight", True)  # the original constructor's defaults
    cutoffs = list(fields.get("cutoffs", []))
    tie_projs = [bool(t) for t in fields.get("tie_projs", [False])]
    # The original defaults to tie_projs=[False] and ties only the listed clusters.
    fields["tie_projs"] = (tie_projs + [False] * (len(cutoffs) + 1))[: len(cutoffs) + 1]
    return fields


# -- whole pickled module --------------------------------------------------------------------------------
def is_pickled_module(obj) -> bool:
    if pickled_class(obj) in _WRAPPERS:
        obj = submodule(obj, "module")
    return pickled_class(obj) == MODEL_CLASS


def load_module(root, path, config=None) -> LoadedModel:
    if pickled_class(root) in _WRAPPERS:
        root = submodule(root, "module")
    check_supported(attr(root, "attn_type", 0), attr(root, "sample_softmax", -1), path)
    state = rename(strip_prefix(module_tree_state_dict(root, path), "module."), CMU_RULES, path, "CMU")

    def need(obj, name, where):
        value = attr(obj, name)
        if value is None:
            raise CheckpointError(path, f"pickled {where} has no attribute {name!r}")
        return value

    word_emb, crit = submodule(root, "word_emb"), submodule(root, "crit")
    pos_ff, dec_attn = submodule(root, "layers.0.pos_ff"), submodule(root, "layers.0.dec_attn")
    for obj, where in ((word_emb, "word_emb"), (crit, "crit"), (pos_ff, "layers.0.pos_ff"),
                       (dec_attn, "layers.0.dec_attn")):
        if obj is None:
            raise CheckpointError(path, f"pickled MemTransformerLM has no {where} module")
    try:
        d_model = int(need(root, "d_model", "MemTransformerLM"))
        n_token = int(need(root, "n_token", "MemTransformerLM"))
        # The original appends n_token to the cutoffs it is given.
        cutoffs = [int(c) for c in need(crit, "cutoffs", "crit")][:-1]
        div_val = int(need(word_emb, "div_val", "word_emb"))
        d_embed = int(attr(root, "d_embed", d_model))
        layer_norm = submodule(pos_ff, "layer_norm")
        untie_r = "r_w_bias" not in state and any(k.endswith("dec_attn.r_w_bias") for k in state)
        tie_weight, tie_projs = infer_ties(state, cutoffs, div_val, d_model, d_embed)
        if attr(root, "tie_weight") is not None:  # recorded by NVIDIA-style pickles
            tie_weight = bool(attr(root, "tie_weight"))
        fields = dict(
            n_token=n_token, n_layer=int(need(root, "n_layer", "MemTransformerLM")),
            n_head=int(need(root, "n_head", "MemTransformerLM")), d_model=d_model,
            d_head=int(need(root, "d_head", "MemTransformerLM")), d_inner=int(need(pos_ff, "d_inner", "pos_ff")),
            d_embed=d_embed, cutoffs=cutoffs, div_val=div_val, tie_weight=tie_weight, tie_projs=tie_projs,
            pre_lnorm=bool(attr(dec_attn, "pre_lnorm", False)), untie_r=untie_r,
            mem_len=int(attr(root, "mem_len", 0) or 0), tgt_len=int(attr(root, "tgt_len", 128) or 128),
            clamp_len=int(attr(root, "clamp_len", -1)), same_length=bool(attr(root, "same_length", False)),
            layer_norm_epsilon=float(attr(layer_norm, "eps", 1e-5)),
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(path, f"pickled MemTransformerLM has a malformed hyper-parameter ({e})") from None
    cfg = _config(fields, path)
    notes = []
    if int(attr(root, "ext_len", 0) or 0) > 0:
        notes.append(f"trained with ext_len={attr(root, 'ext_len')}; evaluated with ext_len 0 (the paper's setting)")
    return LoadedModel(cfg, normalise(state, cfg, path), None, "cmu", str(path), notes=notes)


# -- bare state_dict + config ----------------------------------------------------------------------------
_STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model_state")


def unwrap_state_dict(obj):
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    if isinstance(obj, dict) and len(obj) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in _STATE_DICT_WRAPPERS:
            if key in obj and "model_config" not in obj:
                return unwrap_state_dict(obj[key])
    return None


def is_state_dict(obj) -> bool:
    return unwrap_state_dict(obj) is not None


def config_from_json(data, path) -> TxlConfig | dict:
    """A config for a bare state_dict: our TxlConfig (bare, or our config.json with `format`/`config`) or the
    original constructor's keyword arguments. Returns TxlConfig fields."""
    if isinstance(data, dict) and data.get("format") == "txl-deploy" and isinstance(data.get("config"), dict):
        data = data["config"]
    return config_fields_from_kwargs(data, path, "CMU")


def load_state_dict(obj, path, config=None) -> LoadedModel:
    """`config`: a TxlConfig, or a dict of TxlConfig fields / original constructor kwargs, with `_path`."""
    if config is None:
        raise CheckpointError(path, "is a bare state_dict: it needs a config (pass --config FILE, or put "
                                    f"{path.stem}.json or config.json beside it)")
    state = rename(strip_prefix(unwrap_state_dict(obj), "module."), CMU_RULES, path, "CMU")
    if isinstance(config, TxlConfig):
        cfg = config
    else:
        config = dict(config)
        config_path = config.pop("_path", path)
        cfg = _config(config_from_json(config, config_path), config_path)
    return LoadedModel(cfg, normalise(state, cfg, path), None, "cmu-state-dict", str(path))


def find_config(path: Path, config):
    """The config of a bare state_dict: given, or `<stem>.json` / `config.json` beside it, or None."""
    if isinstance(config, TxlConfig):
        return config
    if isinstance(config, dict):
        return {**config, "_path": config.get("_path", "<config>")}
    if config is None:
        for candidate in (path.with_suffix(".json"), path.parent / "config.json"):
            if candidate.is_file() and candidate != path:
                config = candidate
                break
        else:
            return None
    return {**read_json_object(config), "_path": str(config)}


def _read_state_dict(source: Source) -> LoadedModel:
    return load_state_dict(source.payload, source.file, find_config(source.file, source.config))


MODEL_PT = Reader("cmu", "the original CMU code's model.pt (torch.save of the whole MemTransformerLM)",
                  lambda s: is_pickled_module(s.payload), lambda s: load_module(s.payload, s.file))
STATE_DICT = Reader("cmu-state-dict", "a state_dict in the original CMU names (.pt or .safetensors) and a JSON "
                    "config", lambda s: is_state_dict(s.payload), _read_state_dict,
                    takes=frozenset({"config"}))
