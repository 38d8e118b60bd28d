"""The original TensorFlow checkpoints (kimiyoung/transformer-xl `tf/`): the paper's own pretrained models.

`tf/sota/download.sh` fetches, per dataset, a folder `pretrained_xl/tf_<name>/` with
`model/model.ckpt-N.{index,data-00000-of-00001,meta}` (+ a `checkpoint` file) and `data/cache.pkl` (the pickled
corpus, holding the vocabulary) + `data/corpus-info.json` (vocabulary size, cutoffs, dataset name).
`convert` takes that folder as it is, or a `model.ckpt-N` path (with `--vocab`, or the layout around it).

The weights are read by `tf_bundle` (no TensorFlow needed). A TF checkpoint stores no hyper-parameters: the
variable shapes determine the architecture, and the evaluation settings (tgt_len, mem_len, clamp_len,
same_length) come from a preset of the published run scripts (`tf/sota/*.sh`) or from the original training
flags (`--config FILE`, JSON with `tf/train_gpu.py`'s flag names). The shapes are checked against either.

What the original TF code computes differently from the PyTorch code, and what the converted config says:
- `same_length`: TF's `_create_mask` lets each query see `mlen + 1` keys, and its evaluation always runs with a
  full memory (mlen == mem_len), so the window is one key longer than the PyTorch code's: `same_length_extra = 1`.
- `tf.contrib.layers.layer_norm` uses epsilon 1e-12: `layer_norm_epsilon = 1e-12`.
- the first memory is `mem_len` zero vectors that are attended to (see the README); ours starts empty.

Layouts (from `tf/model.py`): dense kernels are [in, out] (ours: [out, in]); the embedding computes
`emb @ proj_W` (our `emb_projs[i]` is `proj_W.T`) and the softmax `hidden @ proj.T` (our `out_projs[i]` is
`proj.T`); `qkv` splits into q, k, v along its last axis, as ours; the softmax weights are always the embedding
tables; a tied projection has no `adaptive_softmax/cutoff_i/proj`; with `proj_same_dim=False` a cluster whose
embedding size equals d_model has no projection at all (ours then holds an identity, which is exact); tail cluster
i reads head column `cutoffs[0] + i - 1` (HuggingFace's order), so the cluster rows are reversed into ours.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..config import TxlConfig
from ..errors import CheckpointError, TxlError
from .ours import LoadedModel, read_json_object

FORMAT = "tensorflow"
TF_LAYER_NORM_EPSILON = 1e-12
TF_SAME_LENGTH_EXTRA = 1

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

# Variables a checkpoint may hold that are not model weights: the step counter, Adam's slots and powers.
IGNORED = re.compile(r"(.*/)?global_step|.*/Adam(_\d+)?|(.*/)?beta[12]_power(_\d+)?|_CHECKPOINTABLE_OBJECT_GRAPH")

# The original variable names below the model scope (`transformer/` in every published checkpoint).
LAYER_VARS = {
    "rel_attn/qkv/kernel", "rel_attn/r/kernel", "rel_attn/o/kernel", "rel_attn/LayerNorm/gamma",
    "rel_attn/LayerNorm/beta", "ff/layer_1/kernel", "ff/layer_1/bias", "ff/layer_2/kernel", "ff/layer_2/bias",
    "ff/LayerNorm/gamma", "ff/LayerNorm/beta",
}
NAME_PATTERNS = [
    re.compile(r"(r_w_bias|r_r_bias)"),
    re.compile(r"layer_(\d+)/(" + "|".join(sorted(LAYER_VARS)) + ")"),
    re.compile(r"adaptive_embed/(lookup_table|proj_W)"),
    re.compile(r"adaptive_embed/cutoff_(\d+)/(lookup_table|proj_W)"),
    re.compile(r"adaptive_softmax/bias"),
    re.compile(r"adaptive_softmax/cutoff_(\d+)/(b|proj)"),
    re.compile(r"adaptive_softmax/cutoff_0/(cluster_W|cluster_b)"),
]


# -- finding the files ---------------------------------------------------------------------------------------
def _latest_prefix(model_dir: Path) -> Path | None:
    """The checkpoint a `model/` folder holds: the one its `checkpoint` file names, else the highest step."""
    state = model_dir / "checkpoint"
    if state.is_file():
        m = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', state.read_text(errors="replace"), re.M)
        if m:
            # The file often holds an absolute path of the machine (or folder) it was written in: the checkpoint
            # of that name in this folder comes first, so a moved or copied folder reads its own files.
            named = Path(m.group(1))
            for prefix in (model_dir / named.name, named if named.is_absolute() else model_dir / named):
                if Path(str(prefix) + ".index").is_file():
                    return prefix
    indexes = sorted(model_dir.glob("*.index"), key=lambda p: [int(x) if x.isdigit() else x
                                                               for x in re.split(r"(\d+)", p.name)])
    return Path(str(indexes[-1])[: -len(".index")]) if indexes else None


def find_checkpoint(path) -> tuple[Path, Path | None] | None:
    """(checkpoint prefix, data folder or None) if `path` is a TF checkpoint or the published folder layout."""
    path = Path(path)
    if path.is_dir():
        for model_dir, data_dir in ((path / "model", path / "data"), (path, path.parent / "data")):
            if model_dir.is_dir():
                prefix = _latest_prefix(model_dir)
                if prefix is not None:
                    return prefix, data_dir if data_dir.is_dir() else None
        return None
    text = str(path)
    if ".data-" in path.name:
        text = text[: text.rindex(".data-")]
    for suffix in (".index", ".meta"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
    prefix = Path(text)
    if not Path(text + ".index").is_file():
        return None
    data_dir = prefix.parent.parent / "data"
    return prefix, data_dir if (data_dir / "cache.pkl").is_file() or (data_dir / "corpus-info.json").is_file() \
        else None


def is_tf_checkpoint(path) -> bool:
    return find_checkpoint(path) is not None


# -- shapes -> architecture ----------------------------------------------------------------------------------
def _model_names(shapes: dict, path) -> tuple[str, dict]:
    """The model scope (`transformer/`) and {name below it: shape} of the weights; other variables are refused."""
    weights = {n: s for n, s in shapes.items() if not IGNORED.fullmatch(n)}
    anchor = next((n for n in sorted(weights) if n.endswith("r_w_bias")), None)
    if anchor is None:
        raise CheckpointError(path, "has no r_w_bias variable: not an original TensorFlow Transformer-XL checkpoint")
    scope = anchor[: -len("r_w_bias")]
    out = {}
    for name in sorted(weights):
        local = name[len(scope):] if name.startswith(scope) else None
        if local is None or not any(p.fullmatch(local) for p in NAME_PATTERNS):
            raise CheckpointError(path, f"variable {name!r} is not part of an original TensorFlow Transformer-XL "
                                        f"(expected names like {scope}layer_0/rel_attn/qkv/kernel)")
        out[local] = tuple(weights[name])
    return scope, out


def infer_architecture(shapes: dict, path="<checkpoint>") -> dict:
    """What the variable shapes determine, in the flag names of tf/train_gpu.py plus n_token, cutoffs, tie_projs.

    `shapes`: {variable name: shape}. Raises CheckpointError naming the first variable that fits no supported
    configuration."""
    scope, v = _model_names(shapes, path)
    full = lambda local: scope + local  # noqa: E731

    def need(local):
        if local not in v:
            raise CheckpointError(path, f"variable {full(local)!r} is missing")
        return v[local]

    def expect(local, shape):
        if need(local) != tuple(shape):
            raise CheckpointError(path, f"variable {full(local)!r} has shape {list(v[local])}, expected "
                                        f"{list(shape)} for the shapes of the other variables")

    layers = sorted({int(m.group(1)) for n in v if (m := re.match(r"layer_(\d+)/", n))})
    if not layers:
        raise CheckpointError(path, f"has no {scope}layer_N variables")
    n_layer = layers[-1] + 1
    rw = need("r_w_bias")
    if len(rw) == 3:
        untie_r, (n_rb, n_head, d_head) = True, rw
        if n_rb != n_layer:
            raise CheckpointError(path, f"variable {full('r_w_bias')!r} has {n_rb} layers of biases, the checkpoint "
                                        f"{n_layer} layers")
    elif len(rw) == 2:
        untie_r, (n_head, d_head) = False, rw
    else:
        raise CheckpointError(path, f"variable {full('r_w_bias')!r} has shape {list(rw)}, expected "
                                    "[n_head, d_head] or [n_layer, n_head, d_head]")
    expect("r_r_bias", rw)
    qkv = need("layer_0/rel_attn/qkv/kernel")
    if len(qkv) != 2:
        raise CheckpointError(path, f"variable {full('layer_0/rel_attn/qkv/kernel')!r} is not a matrix")
    d_model, hd = qkv[0], n_head * d_head
    d_inner = need("layer_0/ff/layer_1/kernel")[-1]
    for i in range(n_layer):
        p = f"layer_{i}/"
        for local, shape in (("rel_attn/qkv/kernel", (d_model, 3 * hd)), ("rel_attn/r/kernel", (d_model, hd)),
                             ("rel_attn/o/kernel", (hd, d_model)), ("ff/layer_1/kernel", (d_model, d_inner)),
                             ("ff/layer_1/bias", (d_inner,)), ("ff/layer_2/kernel", (d_inner, d_model)),
                             ("ff/layer_2/bias", (d_model,)), ("rel_attn/LayerNorm/gamma", (d_model,)),
                             ("rel_attn/LayerNorm/beta", (d_model,)), ("ff/LayerNorm/gamma", (d_model,)),
                             ("ff/LayerNorm/beta", (d_model,))):
            expect(p + local, shape)

    arch = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, d_head=d_head, d_inner=d_inner, untie_r=untie_r)
    if "adaptive_embed/lookup_table" in v:  # div_val 1: one table, one optional projection
        n_token, d_embed = need("adaptive_embed/lookup_table")
        has_proj = d_embed != d_model
        if has_proj:
            expect("adaptive_embed/proj_W", (d_embed, d_model))
        elif "adaptive_embed/proj_W" in v:
            raise CheckpointError(path, f"variable {full('adaptive_embed/proj_W')!r} is unexpected: d_embed equals "
                                        "d_model")
        if "adaptive_softmax/bias" in v:
            cutoffs = []
            expect("adaptive_softmax/bias", (n_token,))
        else:
            sizes = _cluster_sizes(v, "adaptive_softmax/cutoff_{}/b", path, scope)
            if sum(sizes) != n_token:
                raise CheckpointError(path, f"the adaptive softmax biases cover {sum(sizes)} tokens, the embedding "
                                            f"{n_token}")
            cutoffs = list(np.cumsum(sizes)[:-1].tolist())
        tie_projs = []
        for i in range(len(cutoffs) + 1):
            proj = f"adaptive_softmax/cutoff_{i}/proj"
            if not cutoffs or proj not in v:
                tie_projs.append(has_proj)  # no cutoffs: the softmax always reuses the embedding's proj_W
            elif not has_proj:
                raise CheckpointError(path, f"variable {full(proj)!r} is unexpected: d_embed equals d_model")
            else:
                expect(proj, (d_embed, d_model))
                tie_projs.append(False)
        arch.update(div_val=1, proj_same_dim=True)
    else:
        sizes = _cluster_sizes(v, "adaptive_embed/cutoff_{}/lookup_table", path, scope, dim=0)
        dims = [need(f"adaptive_embed/cutoff_{i}/lookup_table")[1] for i in range(len(sizes))]
        if len(sizes) < 2:
            raise CheckpointError(path, f"variable {full('adaptive_embed/cutoff_0/lookup_table')!r}: an adaptive "
                                        "embedding needs at least two clusters")
        d_embed = dims[0]
        div_val = dims[0] // dims[1] if dims[1] else 0
        for i, d in enumerate(dims):
            if div_val < 1 or d != d_embed // div_val**i:
                raise CheckpointError(path, f"variable {full(f'adaptive_embed/cutoff_{i}/lookup_table')!r} has "
                                            f"width {d}, which fits no div_val (cluster 0: {d_embed}, cluster 1: "
                                            f"{dims[1]})")
        n_token, cutoffs = sum(sizes), list(np.cumsum(sizes)[:-1].tolist())
        proj_same_dim = True
        for i, d in enumerate(dims):
            name = f"adaptive_embed/cutoff_{i}/proj_W"
            if name in v:
                expect(name, (d, d_model))
            elif d == d_model:
                proj_same_dim = False  # the lm1b setting: no projection where none is needed
            else:
                need(name)
        tie_projs = []
        for i, d in enumerate(dims):
            name = f"adaptive_softmax/cutoff_{i}/proj"
            if name in v:
                expect(name, (d, d_model))
                tie_projs.append(False)
            else:
                # Tied to the embedding's proj_W, or (proj_same_dim False, width d_model) no projection on either
                # side: both are the embedding's projection (an identity in the second case).
                tie_projs.append(True)
        arch.update(div_val=div_val, proj_same_dim=proj_same_dim)
        if not proj_same_dim and any(f"adaptive_embed/cutoff_{i}/proj_W" in v and d == d_model
                                     for i, d in enumerate(dims)):
            raise CheckpointError(path, "some clusters of width d_model have a projection and some do not")
    if cutoffs:
        n_c = len(cutoffs)
        expect("adaptive_softmax/cutoff_0/cluster_W", (n_c, d_embed))
        expect("adaptive_softmax/cutoff_0/cluster_b", (n_c,))
        bounds = [0] + cutoffs + [n_token]
        for i in range(n_c + 1):
            expect(f"adaptive_softmax/cutoff_{i}/b", (bounds[i + 1] - bounds[i],))
    for local in v:
        m = re.match(r"(?:adaptive_embed|adaptive_softmax)/cutoff_(\d+)/", local)
        if m and int(m.group(1)) > len(cutoffs):
            raise CheckpointError(path, f"variable {full(local)!r} is beyond the last cluster")
        if not cutoffs and (local.startswith("adaptive_softmax/cutoff_") or local.startswith("adaptive_embed/cutoff_")):
            raise CheckpointError(path, f"variable {full(local)!r} is unexpected in a model without cutoffs")
    arch.update(n_token=n_token, d_embed=d_embed, cutoffs=cutoffs, tie_projs=tie_projs,
                proj_share_all_but_first=bool(tie_projs[1:]) and all(tie_projs[1:]))
    arch["_scope"] = scope
    return arch


def _cluster_sizes(v, template, path, scope, dim=0) -> list[int]:
    sizes, i = [], 0
    while template.format(i) in v:
        sizes.append(v[template.format(i)][dim])
        i += 1
    if not sizes:
        raise CheckpointError(path, f"variable {scope}{template.format(0)!r} is missing")
    return sizes


# -- presets and training flags ------------------------------------------------------------------------------
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


def _settings(arch: dict, preset: str | None, flags: dict | None, flags_where: str | None,
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


# -- vocabulary ----------------------------------------------------------------------------------------------
def _corpus_unpickler():
    import pickle

    from . import safe_pickle

    def skipped_array(*args, **kwargs):
        # The encoded splits (numpy arrays) beside the vocabulary: never rebuilt, only skipped.
        return safe_pickle.inert_class("numpy", "ndarray")()

    skipped = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "dtype"),
        ("numpy", "ndarray"),
    }
    corpus_classes = {("data_utils", "Corpus"), ("__main__", "Corpus"), ("vocabulary", "Vocab"),
                      ("__main__", "Vocab"), ("data_utils", "Vocab")}

    class CorpusUnpickler(safe_pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in skipped:
                return skipped_array
            if (module, name) in corpus_classes:
                return safe_pickle.inert_class(module, name)
            if (module, name) in {("collections", "OrderedDict"), ("collections", "Counter")} or module in (
                    "__builtin__", "builtins", "copy_reg", "copyreg", "_codecs"):
                return super().find_class(module, name)
            raise safe_pickle.RefusedGlobal(module, name)

    return CorpusUnpickler, pickle


def _text(value) -> str:
    if isinstance(value, bytes):  # a Python 2 str: the bytes of the file it was read from, UTF-8 in practice
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value.decode("latin1")
    return str(value)


def _attr(obj, name):
    d = getattr(obj, "__dict__", {})
    return d.get(name, d.get(name.encode()))


def read_cache_vocab(path):
    """The vocabulary of `data/cache.pkl` (a pickled `data_utils.Corpus` holding a `vocabulary.Vocab`), read with
    the restricted unpickler: only the symbol list and the plain containers around it are rebuilt, the numpy
    arrays of the encoded splits are skipped, and any other global (code) refuses the file before anything runs.

    Python 2 pickles are read with `encoding="bytes"`: their str objects come back as bytes and are decoded as
    UTF-8 (what the original code read its text files as), so a word like "café" is not turned into mojibake as a
    latin1 reading would."""
    from ..vocab import Vocab
    from .safe_pickle import RefusedGlobal, pickled_class

    path = Path(path)
    Unpickler, pickle = _corpus_unpickler()
    try:
        with open(path, "rb") as f:
            corpus = Unpickler(f, encoding="bytes").load()
    except FileNotFoundError:
        raise CheckpointError(path, "vocabulary file not found") from None
    except RefusedGlobal as e:
        raise CheckpointError(path, f"refused to unpickle {e.module}.{e.name}: a corpus cache holds only the "
                                    "vocabulary, plain containers and arrays (nothing from the file was run)") from None
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OSError, MemoryError) as e:
        raise CheckpointError(path, f"truncated or corrupt pickle ({type(e).__name__}: {str(e)[:120]})") from None
    vocab = corpus if (pickled_class(corpus) or "").endswith(".Vocab") else _attr(corpus, "vocab")
    symbols = _attr(vocab, "idx2sym") if vocab is not None else None
    if not isinstance(symbols, list):
        raise CheckpointError(path, f"is not a Transformer-XL corpus cache (no vocab.idx2sym list in "
                                    f"{pickled_class(corpus) or type(corpus).__name__})")
    try:
        return Vocab([_text(s) for s in symbols], kind="word"), _text(_attr(corpus, "dataset") or "")
    except ValueError as e:
        raise CheckpointError(path, str(e)) from None


def read_corpus_info(path) -> dict:
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"unreadable corpus-info.json ({e})") from None
    if not isinstance(info, dict):
        raise CheckpointError(path, "corpus-info.json is not a JSON object")
    return info


def _check_corpus_info(info: dict, arch: dict, where) -> None:
    size = info.get("vocab_size")
    if size is not None and int(size) != arch["n_token"]:
        raise CheckpointError(where, f"vocab_size {size} but the checkpoint's embedding has {arch['n_token']} rows")
    cutoffs = [int(c) for c in info.get("cutoffs") or []]
    # corpus-info.json lists 0 and the vocabulary size around the cutoffs (train_gpu.py reads [1:-1]).
    inner = cutoffs[1:-1] if cutoffs else []
    if inner != list(arch["cutoffs"]):
        raise CheckpointError(where, f"cutoffs {cutoffs} but the checkpoint's clusters end at "
                                     f"{arch['cutoffs'] + [arch['n_token']]}")


# -- loading -------------------------------------------------------------------------------------------------
def to_state_dict(ckpt, arch: dict) -> dict:
    """The checkpoint's tensors under our names and in our orientation (torch tensors)."""
    import torch

    scope = arch["_scope"]

    def get(local):
        return ckpt.get_tensor(scope + local).astype(np.float32, copy=False)

    def t(a):
        return torch.from_numpy(np.array(a, dtype=np.float32, order="C"))  # a copy: transposed/reversed views

    sd = {}
    n_layer, div_val, cutoffs, d_model = arch["n_layer"], arch["div_val"], arch["cutoffs"], arch["d_model"]
    for i in range(n_layer):
        p, q = f"layer_{i}/", f"layers.{i}."
        sd[q + "dec_attn.qkv_net.weight"] = t(get(p + "rel_attn/qkv/kernel").T)  # TF kernels are [in, out]
        sd[q + "dec_attn.r_net.weight"] = t(get(p + "rel_attn/r/kernel").T)
        sd[q + "dec_attn.o_net.weight"] = t(get(p + "rel_attn/o/kernel").T)
        sd[q + "dec_attn.layer_norm.weight"] = t(get(p + "rel_attn/LayerNorm/gamma"))
        sd[q + "dec_attn.layer_norm.bias"] = t(get(p + "rel_attn/LayerNorm/beta"))
        sd[q + "pos_ff.CoreNet.0.weight"] = t(get(p + "ff/layer_1/kernel").T)
        sd[q + "pos_ff.CoreNet.0.bias"] = t(get(p + "ff/layer_1/bias"))
        sd[q + "pos_ff.CoreNet.3.weight"] = t(get(p + "ff/layer_2/kernel").T)
        sd[q + "pos_ff.CoreNet.3.bias"] = t(get(p + "ff/layer_2/bias"))
        sd[q + "pos_ff.layer_norm.weight"] = t(get(p + "ff/LayerNorm/gamma"))
        sd[q + "pos_ff.layer_norm.bias"] = t(get(p + "ff/LayerNorm/beta"))
    for bias in ("r_w_bias", "r_r_bias"):
        value = get(bias)
        if arch["untie_r"]:
            for i in range(n_layer):
                sd[f"layers.{i}.dec_attn.{bias}"] = t(value[i])
        else:
            sd[bias] = t(value)
    names = set(ckpt.names())
    if div_val == 1:
        sd["word_emb.emb_layers.0.weight"] = t(get("adaptive_embed/lookup_table"))
        if arch["d_embed"] != d_model:
            sd["word_emb.emb_projs.0"] = t(get("adaptive_embed/proj_W").T)  # emb @ proj_W
        if cutoffs:
            sd["crit.out_layers.0.bias"] = t(np.concatenate([get(f"adaptive_softmax/cutoff_{i}/b")
                                                             for i in range(len(cutoffs) + 1)]))
        else:
            sd["crit.out_layers.0.bias"] = t(get("adaptive_softmax/bias"))
    else:
        for i in range(len(cutoffs) + 1):
            sd[f"word_emb.emb_layers.{i}.weight"] = t(get(f"adaptive_embed/cutoff_{i}/lookup_table"))
            if scope + f"adaptive_embed/cutoff_{i}/proj_W" in names:
                sd[f"word_emb.emb_projs.{i}"] = t(get(f"adaptive_embed/cutoff_{i}/proj_W").T)
            else:  # proj_same_dim=False: no projection; ours always has one, and an identity is exact
                sd[f"word_emb.emb_projs.{i}"] = torch.eye(d_model)
            sd[f"crit.out_layers.{i}.bias"] = t(get(f"adaptive_softmax/cutoff_{i}/b"))
    for i, tied in enumerate(arch["tie_projs"]):
        if not tied and (div_val > 1 or arch["d_embed"] != d_model):
            sd[f"crit.out_projs.{i}"] = t(get(f"adaptive_softmax/cutoff_{i}/proj").T)  # hidden @ proj.T
    if cutoffs:
        # TF reads tail cluster i from head column cutoffs[0] + i - 1, ours from column -i: reversed rows.
        sd["crit.cluster_weight"] = t(get("adaptive_softmax/cutoff_0/cluster_W")[::-1])
        sd["crit.cluster_bias"] = t(get("adaptive_softmax/cutoff_0/cluster_b")[::-1])
    return sd


def load_checkpoint(path, config=None, preset: str | None = None, vocab=None, vocab_kind: str | None = None,
                    verify_checksums: bool = True):
    """A `LoadedModel` from the published folder layout or a `model.ckpt-N` path.

    `config`: the original training flags (JSON file or dict, tf/train_gpu.py names); `preset`: one of PRESETS;
    `vocab`: a `cache.pkl` (read safely) or a text vocabulary (`vocab_kind` word or char), overriding
    `data/cache.pkl`."""
    from ..vocab import Vocab
    from .tf_bundle import TFCheckpoint

    found = find_checkpoint(path)
    if found is None:
        raise CheckpointError(path, "is not a TensorFlow checkpoint (no model.ckpt-N.index)")
    prefix, data_dir = found
    if config is not None and preset is not None:
        raise CheckpointError(path, "pass either --preset or --config, not both")
    ckpt = TFCheckpoint(prefix, verify_checksums=verify_checksums)
    where = ckpt.index_path
    arch = infer_architecture({n: e.shape for n, e in ckpt.entries.items()}, where)

    notes = []
    loaded_vocab, vocab_source, dataset = None, None, None
    cache = Path(vocab) if vocab is not None else (data_dir / "cache.pkl" if data_dir is not None else None)
    if cache is not None and cache.suffix == ".pkl":
        loaded_vocab, dataset = read_cache_vocab(cache)
        vocab_source = str(cache)
    elif cache is not None:
        loaded_vocab, vocab_source = Vocab.read(cache, kind=vocab_kind), str(cache)
    info_path = data_dir / "corpus-info.json" if data_dir is not None else None
    if info_path is not None and info_path.is_file():
        info = read_corpus_info(info_path)
        _check_corpus_info(info, arch, info_path)
        dataset = dataset or info.get("dataset")
    if loaded_vocab is not None and len(loaded_vocab) != arch["n_token"]:
        raise CheckpointError(vocab_source, f"vocabulary has {len(loaded_vocab)} symbols but the checkpoint's "
                                            f"embedding has {arch['n_token']} rows")

    flags, flags_where = (read_flags(config, where) if config is not None else (None, None))
    settings, sources = _settings(arch, preset, flags, flags_where, dataset, where)
    chosen = sources.pop("_preset", None)
    try:
        cfg = TxlConfig(
            n_token=arch["n_token"], n_layer=arch["n_layer"], n_head=arch["n_head"], d_model=arch["d_model"],
            d_head=arch["d_head"], d_inner=arch["d_inner"], d_embed=arch["d_embed"], cutoffs=arch["cutoffs"],
            div_val=arch["div_val"], tie_weight=True, tie_projs=arch["tie_projs"], pre_lnorm=False,
            untie_r=arch["untie_r"], mem_len=int(settings["mem_len"]), tgt_len=int(settings["tgt_len"]),
            clamp_len=int(settings["clamp_len"]), same_length=bool(settings["same_length"]),
            same_length_extra=TF_SAME_LENGTH_EXTRA, layer_norm_epsilon=TF_LAYER_NORM_EPSILON,
        )
    except TxlError as e:
        raise CheckpointError(where, str(e)) from None
    state = to_state_dict(ckpt, arch)
    notes.append("TensorFlow evaluation starts every stream from mem_len zero vectors that are attended to; "
                 "txl-deploy starts it empty as the paper's PyTorch code does, so the first "
                 "~n_layer*ceil(mem_len/tgt_len) segments differ slightly (see the README)")
    if chosen is not None:
        notes.append(f"evaluation settings of {chosen}; the paper reports {PAPER_RESULTS[chosen]} for it")
    loaded = LoadedModel(cfg, state, loaded_vocab, FORMAT, str(prefix), notes=notes, vocab_source=vocab_source)
    loaded.value_sources = sources
    return loaded
