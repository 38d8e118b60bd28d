"""Evaluation settings for a TensorFlow checkpoint: a preset of the paper's run scripts (tf/sota/*.sh), chosen by
name or by the shapes, or the original training flags (`--config FILE`, JSON with tf/train_gpu.py's names)."""

from __future__ import annotations

from txl_deploy.checkpoints.native import read_json_object
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError

# The four published models (tf/sota/{enwik8,text8,wt103,lm1b}.sh): training shapes and evaluation settings.
# n_token/cutoffs are not listed: they come from the checkpoint (and corpus-info.json).
_ENWIK8_LARGE = dict(
    n_layer=24, d_model=1024, d_embed=1024, n_head=8, d_head=128, d_inner=3072, div_val=1, untie_r=False,
    proj_share_all_but_first=False, proj_same_dim=True,
    tgt_len=128, mem_len=3800, clamp_len=1000, same_length=True,
)
PRESETS: dict[str, dict] = {
    "enwik8-large": _ENWIK8_LARGE,
    "text8-large": dict(_ENWIK8_LARGE),  # text8.sh trains and evaluates enwik8's shape with enwik8's settings
    "wt103-large": dict(
        n_layer=18, d_model=1024, d_embed=1024, n_head=16, d_head=64, d_inner=4096, div_val=4, untie_r=True,
        proj_share_all_but_first=True, proj_same_dim=True,
        tgt_len=128, mem_len=1600, clamp_len=1000, same_length=True,
    ),
    "lm1b-large": dict(
        n_layer=24, d_model=1280, d_embed=1280, n_head=16, d_head=80, d_inner=8192, div_val=4, untie_r=True,
        proj_share_all_but_first=False, proj_same_dim=False,
        tgt_len=32, mem_len=128, clamp_len=-1, same_length=False,
    ),
}
# corpus-info.json's "dataset" -> the preset of its published model (enwik8 and text8 share their shapes).
DATASET_PRESETS = {"enwik8": "enwik8-large", "text8": "text8-large", "wt103": "wt103-large", "lm1b": "lm1b-large"}
PAPER_RESULTS = {"enwik8-large": "0.99 bpc", "text8-large": "1.08 bpc", "wt103-large": "18.3 ppl",
                 "lm1b-large": "21.8 ppl"}

SHAPE_FLAGS = ("n_layer", "d_model", "d_embed", "n_head", "d_head", "d_inner", "div_val", "untie_r",
               "proj_share_all_but_first", "proj_same_dim")
EVAL_FLAGS = ("tgt_len", "mem_len", "clamp_len", "same_length")
# tf/train_gpu.py's defaults for the evaluation flags (used with --config when a flag is left out).
EVAL_DEFAULTS = dict(tgt_len=70, mem_len=70, clamp_len=-1, same_length=False)
# The other flags of tf/train_gpu.py and tf/train.py: accepted in --config, irrelevant to inference.
OTHER_FLAGS = {
    "num_hosts", "num_core_per_host", "data_dir", "record_info_dir", "corpus_info_path", "model_dir", "do_train",
    "do_eval", "eval_ckpt_path", "warm_start_path", "learning_rate", "clip", "min_lr_ratio", "warmup_steps",
    "train_batch_size", "eval_batch_size", "train_steps", "iterations", "save_steps", "do_test",
    "max_eval_batch", "do_eval_only", "start_eval_steps", "eval_split", "dropout", "dropatt", "init", "init_std",
    "proj_init_std", "init_range", "tie_weight", "use_tpu", "num_passes", "tpu", "tpu_zone", "gcp_project",
    "master", "num_host", "record_info_dir", "max_save", "warm_start_path", "dataset",
}


def _determined(arch: dict) -> dict:
    """The flag values the shapes pin down. proj_share_all_but_first and proj_same_dim only where they matter."""
    out = {k: arch[k] for k in ("n_layer", "d_model", "d_embed", "n_head", "d_head", "d_inner", "div_val",
                                "untie_r")}
    if arch["div_val"] > 1 or (arch["cutoffs"] and arch["d_embed"] != arch["d_model"]):
        out["proj_share_all_but_first"] = arch["proj_share_all_but_first"]
    if arch["div_val"] > 1 and any(arch["d_embed"] // arch["div_val"] ** i == arch["d_model"]
                                   for i in range(len(arch["cutoffs"]) + 1)):
        out["proj_same_dim"] = arch["proj_same_dim"]
    return out


def _mismatch(flags: dict, arch: dict) -> str | None:
    for key, value in _determined(arch).items():
        if key in flags and flags[key] != value:
            return f"{key}={flags[key]!r} but the checkpoint's shapes say {value!r}"
    return None


def matching_presets(arch: dict) -> list[str]:
    return [name for name, flags in PRESETS.items() if _mismatch(flags, arch) is None]


def read_flags(config, path) -> tuple[dict, str]:
    """Training flags from `--config` (a JSON file of tf/train_gpu.py flag names, or an already-read dict)."""
    if isinstance(config, TxlConfig):
        raise CheckpointError(path, "a TensorFlow checkpoint takes its training flags (JSON with tf/train_gpu.py's "
                                    "flag names), not a TxlConfig")
    if isinstance(config, dict):
        data = dict(config)
        where = str(data.pop("_path", "<config>"))
    else:
        where = str(config)
        data = read_json_object(config, "a JSON object of tf/train_gpu.py flags")
    # absl writes flags with leading dashes in flag files; accept both spellings.
    data = {str(k).lstrip("-"): val for k, val in data.items()}
    unknown = sorted(set(data) - set(SHAPE_FLAGS) - set(EVAL_FLAGS) - OTHER_FLAGS)
    if unknown:
        raise CheckpointError(where, f"unknown training flags: {', '.join(unknown)} (expected tf/train_gpu.py's "
                                     "names: n_layer, d_model, mem_len, same_length, ...)")
    return data, where


def eval_settings(arch: dict, preset: str | None, flags: dict | None, flags_where: str | None,
              dataset: str | None, path) -> tuple[dict, dict]:
    """(evaluation settings, where each value came from)."""
    sources = {k: "checkpoint shapes" for k in ("n_token", "n_layer", "n_head", "d_model", "d_head", "d_inner",
                                                "d_embed", "cutoffs", "div_val", "untie_r", "tie_projs")}
    sources["tie_weight"] = "the TensorFlow code (the softmax always reuses the embedding tables)"
    sources["layer_norm_epsilon"] = "the TensorFlow code (tf.contrib.layers.layer_norm, epsilon 1e-12)"
    sources["same_length_extra"] = "the TensorFlow code (_create_mask: mlen + 1 keys with a full memory)"
    sources["pre_lnorm"] = "the TensorFlow code (post-layer-norm only)"
    if flags is not None:
        problem = _mismatch(flags, arch)
        if problem:
            raise CheckpointError(flags_where, f"{problem}")
        settings = {}
        for key in EVAL_FLAGS:
            if key in flags:
                settings[key], sources[key] = flags[key], f"--config {flags_where}"
            else:
                settings[key], sources[key] = EVAL_DEFAULTS[key], "tf/train_gpu.py default"
        return settings, sources
    if preset is not None:
        if preset not in PRESETS:
            raise CheckpointError(path, f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        problem = _mismatch(PRESETS[preset], arch)
        if problem:
            raise CheckpointError(path, f"does not fit preset {preset}: {problem}")
        chosen, how = preset, f"preset {preset}"
    else:
        candidates = matching_presets(arch)
        if dataset in DATASET_PRESETS and DATASET_PRESETS[dataset] in candidates:
            candidates = [DATASET_PRESETS[dataset]]
        if len(candidates) != 1:
            if candidates:
                raise CheckpointError(path, f"its shapes fit several presets ({', '.join(candidates)}); pass "
                                            "--preset NAME")
            raise CheckpointError(path, f"its shapes fit none of the presets ({', '.join(PRESETS)}): it is not one "
                                        "of the published models; pass --config FILE with its training flags "
                                        "(JSON, tf/train_gpu.py names: tgt_len, mem_len, clamp_len, same_length, "
                                        "...)")
        chosen, how = candidates[0], f"preset {candidates[0]} (the only one the shapes fit)"
    settings = {k: PRESETS[chosen][k] for k in EVAL_FLAGS}
    for key in EVAL_FLAGS:
        sources[key] = f"{how}, from the paper's evaluation script"
    return settings, {**sources, "_preset": chosen}
