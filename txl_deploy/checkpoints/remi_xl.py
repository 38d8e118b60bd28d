"""Compound Word Transformer's `remi-xl` baseline (YatingMusic/compound-word-transformer, workspace/uncond/remi-xl),
whose code and config keys ProgGP uses too.

Its training writes `ep_N.pth.tar`: `torch.save` of a dict with `epoch`, `model_setting` (the MODEL section of the
run's config.yml), `train_setting`, `state_dict`, `best_loss` and `optimizer` (Adam's state). It is read with the
restricted unpickler like every torch file. Without `model_setting` the config is the MODEL section of the
`config.yml` the run folder holds beside it (read with PyYAML's safe loader), or `--config FILE`.

The module is a trimmed copy of the original CMU code, and its state_dict keys are the CMU names except
- `word_emb.lut.weight`: a plain embedding scaled by sqrt(d_model), which is our adaptive embedding at div_val 1
  with d_embed = d_model (its config's own `d_embed` is never used, nor `div_val`);
- `linear_proj.{weight,bias}`: an output layer with a bias, not tied to the embedding: our plain softmax's
  `crit.out_layers.0` with tie_weight off.
d_head is d_model // n_head, layer norms are nn.LayerNorm's (epsilon 1e-5), and the memory starts empty (its
`init_mems`), as ours. pre_lnorm, same_length, clamp_len and mem_len are the config's (the published run: on, on,
-1, 512).
"""

from __future__ import annotations

from pathlib import Path

from txl_deploy.checkpoints.cmu import CMU_RULES, _config, unwrap_state_dict
from txl_deploy.checkpoints.keymap import Rule, normalise, rename, strip_prefix
from txl_deploy.checkpoints.native import LoadedModel
from txl_deploy.checkpoints.reader import Reader, Source, carries_own_config
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError

NAME = "remi-xl"
CONFIG_YML = "config.yml"
MAX_CONFIG_BYTES = 1 << 20  # a run's config.yml is about 2 KB

RULES = [
    Rule(r"word_emb\.lut\.weight", "word_emb.emb_layers.0.weight"),
    Rule(r"linear_proj\.(weight|bias)", r"crit.out_layers.0.\1"),
    *(rule for rule in CMU_RULES if not rule.pattern.startswith(("word_emb", "crit"))),
]
# The MODEL keys its MemTransformerLM computes with (the others: dropout, initialisation, training lengths).
SIZES = ("n_token", "n_layer", "n_head", "d_model", "d_inner", "mem_len", "clamp_len")
SWITCHES = ("pre_lnorm", "same_length")


def _state_dict(obj) -> dict | None:
    state = unwrap_state_dict(obj)
    return None if state is None else strip_prefix(state, "module.")


def claims(source: Source) -> bool:
    state = _state_dict(source.payload)
    return state is not None and "word_emb.lut.weight" in state


def _read_yaml(path: Path) -> dict:
    """The MODEL section of a config.yml (or a JSON file: YAML reads it too)."""
    import yaml  # optional (the music extra): only a remi-xl checkpoint without model_setting needs it

    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise CheckpointError(path, f"is {size:,} bytes, too large for a config.yml")
        data = yaml.safe_load(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(path, "config file not found") from None
    except (OSError, yaml.YAMLError, ValueError, RecursionError) as e:
        raise CheckpointError(path, f"not a readable YAML config ({' '.join(str(e).split())[:200]})") from None
    return _model_section(data, path)


def _model_section(data, where) -> dict:
    if isinstance(data, dict) and isinstance(data.get("MODEL"), dict):
        data = data["MODEL"]
    if not isinstance(data, dict):
        raise CheckpointError(where, "config must be a mapping (the MODEL section of the run's config.yml)")
    return data


def _setting(source: Source):
    """(the MODEL settings or a TxlConfig, where they come from)."""
    obj = source.payload
    if isinstance(obj, dict) and "model_setting" in obj:
        if source.config is not None:
            raise carries_own_config(source.file, NAME)
        return _model_section(obj["model_setting"], f"{source.file}: model_setting"), source.file
    config = source.config
    if isinstance(config, TxlConfig):
        return config, source.file
    if isinstance(config, dict):
        return _model_section(config, "<config>"), "<config>"
    path = Path(config) if config is not None else source.file.parent / CONFIG_YML
    if config is None and not path.is_file():
        raise CheckpointError(source.file, f"holds no model_setting: it needs its run's {CONFIG_YML} beside it, "
                                           "or --config FILE")
    return _read_yaml(path), path


def config_from_setting(setting: dict, where) -> TxlConfig:
    """Our TxlConfig of what remi-xl's MemTransformerLM computes with these MODEL settings."""
    missing = [key for key in (*SIZES, *SWITCHES) if key not in setting]
    if missing:
        raise CheckpointError(where, f"config lacks {', '.join(missing)} (keys of the MODEL section)")
    bad = [key for key in SIZES if not isinstance(setting[key], int) or isinstance(setting[key], bool)]
    bad += [key for key in SWITCHES if not isinstance(setting[key], bool)]
    if bad:
        raise CheckpointError(where, f"config key {bad[0]} is {setting[bad[0]]!r:.40}, not "
                                     f"{'true or false' if bad[0] in SWITCHES else 'an integer'}")
    if setting.get("ext_len", 0) not in (0, None):
        # its generation loop keeps ext_len tokens out of the memory: not what a deployed memory does
        raise CheckpointError(where, f"ext_len {setting['ext_len']!r:.20} is not supported (the published runs use 0)")
    n_head, d_model = setting["n_head"], setting["d_model"]
    tgt_len = setting.get("tgt_len")
    return _config(dict(
        n_token=setting["n_token"], n_layer=setting["n_layer"], n_head=n_head, d_model=d_model,
        d_head=d_model // n_head if n_head > 0 else 0, d_inner=setting["d_inner"], d_embed=d_model,
        tie_weight=False, pre_lnorm=setting["pre_lnorm"], mem_len=setting["mem_len"],
        tgt_len=tgt_len if isinstance(tgt_len, int) and not isinstance(tgt_len, bool) and tgt_len > 0 else 128,
        clamp_len=setting["clamp_len"], same_length=setting["same_length"],
    ), where)


def read(source: Source) -> LoadedModel:
    setting, where = _setting(source)
    cfg = setting if isinstance(setting, TxlConfig) else config_from_setting(setting, where)
    state = normalise(rename(_state_dict(source.payload), RULES, source.file, NAME), cfg, source.file)
    obj = source.payload
    notes = []
    if isinstance(obj, dict) and isinstance(obj.get("epoch"), int):
        notes.append(f"saved after epoch {obj['epoch']} of training")
    if not (isinstance(obj, dict) and "model_setting" in obj):
        notes.append(f"config from {where}")
    return LoadedModel(cfg, state, None, NAME, str(source.file), notes=notes)


READER = Reader(NAME, "Compound Word Transformer's remi-xl (ep_N.pth.tar, config from its model_setting or the "
                "run's config.yml)", claims, read, takes=frozenset({"config"}))
