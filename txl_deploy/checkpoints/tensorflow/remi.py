"""The Pop Music Transformer's checkpoints (YatingMusic/remi): a TF1 `tf.train.Saver` folder (`model.index`,
`model.data-00000-of-00001`, `model.meta`, `checkpoint`) with `dictionary.pkl` beside it.

Its model is the paper's TensorFlow Transformer-XL under other scope names: `normal_embed` / `normal_softmax`
(one tied table and a softmax bias) for `adaptive_embed` / `adaptive_softmax`, and Keras layer norms
`layer_normalization(_N)/{gamma,beta}`, numbered across the whole graph, for `LayerNorm`. The names are mapped onto
the paper's, matching each layer norm by its scope (`rel_attn/` or `ff/`), never by N, and the paper's reader
(`architecture`, `convert.to_state_dict`) does the rest. What the weights do not show is in the config: the
settings hard-coded in model.py (mem_len = x_len 512, clamp_len -1, no same_length), Keras's layer-norm epsilon
1e-3, the ReLU after the feed-forward block's second layer (`ff_out_relu`) and the memory that starts as mem_len
zero vectors that are attended to (`mem_init` "zeros", model.py `generate`). docs/checkpoints.md has the table.
"""

from __future__ import annotations

import re

from txl_deploy.checkpoints.native import LoadedModel
from txl_deploy.checkpoints.reader import Reader, Source
from txl_deploy.checkpoints.tensorflow.architecture import IGNORED, infer_architecture
from txl_deploy.checkpoints.tensorflow.bundle import TFCheckpoint
from txl_deploy.checkpoints.tensorflow.convert import checkpoint_index, found_checkpoint, to_state_dict
from txl_deploy.checkpoints.tensorflow.discovery import find_checkpoint
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError, TxlError

FORMAT = "remi"
# model.py's PopMusicTransformer: x_len = mem_len = 512, same_length False, clamp_len -1, untie_r False.
REMI_SETTINGS = dict(mem_len=512, tgt_len=512, clamp_len=-1, same_length=False)
KERAS_LAYER_NORM_EPSILON = 1e-3  # tf.keras.layers.LayerNormalization's default
SCOPE = "transformer/"
EMBEDDING = SCOPE + "normal_embed/lookup_table"
# REMI name below the scope -> the paper's (the layer norms are matched separately, by scope)
RENAMES = {"normal_embed/lookup_table": "adaptive_embed/lookup_table",
           "normal_embed/proj_W": "adaptive_embed/proj_W",
           "normal_softmax/bias": "adaptive_softmax/bias"}
KERAS_NORM = re.compile(r"(layer_\d+/(?:rel_attn|ff))/layer_normalization(?:_\d+)?/(gamma|beta)")
VALUE_SOURCES = {
    **{k: "checkpoint shapes" for k in ("n_token", "n_layer", "n_head", "d_model", "d_head", "d_inner")},
    **{k: "REMI's model.py (hard-coded)" for k in REMI_SETTINGS},
    "layer_norm_epsilon": "Keras LayerNormalization (epsilon 1e-3)",
    "ff_out_relu": "REMI's modules.py (the feed-forward block's layer_2 has activation relu)",
    "mem_init": "REMI's model.py generate (the memory starts as mem_len zero vectors)",
}


def is_remi_checkpoint(path) -> bool:
    """A TensorFlow checkpoint (folder or prefix) whose index holds REMI's `transformer/normal_embed` table."""
    return _claims(Source(path))


def _claims(source: Source) -> bool:
    if found_checkpoint(source) is None:
        return False
    try:
        return EMBEDDING in checkpoint_index(source).entries  # the index only: no tensor is read
    except CheckpointError:
        return False  # the TensorFlow reader reports what is wrong with it


def paper_names(shapes: dict, where) -> dict:
    """{the paper's variable name: REMI's} for every model weight; anything else REMI's model has not is refused,
    and each layer's two norms must be one per scope."""
    out = {}
    for name in sorted(shapes):
        if IGNORED.fullmatch(name):
            continue
        local = name[len(SCOPE):] if name.startswith(SCOPE) else None
        norm = KERAS_NORM.fullmatch(local) if local is not None else None
        if norm:
            paper = f"{SCOPE}{norm.group(1)}/LayerNorm/{norm.group(2)}"
        elif local is not None:
            paper = SCOPE + RENAMES.get(local, local)
        else:
            raise CheckpointError(where, f"variable {name!r} is not part of a REMI Transformer-XL (expected names "
                                         f"like {SCOPE}layer_0/rel_attn/qkv/kernel)")
        if paper in out:
            what = f"layer norms of {norm.group(1)}" if norm else f"read as {paper!r}"
            raise CheckpointError(where, f"variables {out[paper]!r} and {name!r} are both {what}")
        out[paper] = name
    return out


class _Renamed:
    """The checkpoint seen under the paper's names (what `convert.to_state_dict` reads)."""

    def __init__(self, ckpt: TFCheckpoint, names: dict):
        self.ckpt, self.paper = ckpt, names
        self.index_path = ckpt.index_path

    def names(self):
        return list(self.paper)

    def get_tensor(self, name):
        return self.ckpt.get_tensor(self.paper[name])

    def data_bytes(self):
        return self.ckpt.data_bytes()


def _in_remi_names(message: str, names: dict) -> str:
    for paper, remi in sorted(names.items(), key=lambda kv: -len(kv[0])):
        message = message.replace(repr(paper), repr(remi))
    for remi, paper in RENAMES.items():  # names mentioned without quotes
        message = message.replace(paper, remi)
    return message


def remi_architecture(shapes: dict, where) -> tuple[dict, dict]:
    """({the paper's name: REMI's}, what the shapes determine) of a REMI checkpoint's {variable: shape}; a
    CheckpointError naming REMI's variable for anything its model has not."""
    names = paper_names(shapes, where)
    try:
        arch = infer_architecture({paper: tuple(shapes[remi]) for paper, remi in names.items()}, where)
    except CheckpointError as e:
        raise CheckpointError(where, _in_remi_names(e.problem, names)) from None
    unlike = ("per-layer biases" if arch["untie_r"] else "an embedding projection" if arch["d_embed"] !=
              arch["d_model"] else "an adaptive softmax" if arch["cutoffs"] else None)
    if unlike:
        raise CheckpointError(where, "REMI's model shares one r_w_bias/r_r_bias [n_head, d_head], embeds in d_model "
                                     f"and has a plain softmax; this checkpoint has {unlike}")
    return names, arch


def load_remi(path, config=None, preset=None, verify_checksums: bool = True, found: tuple | None = None,
              ckpt: TFCheckpoint | None = None) -> LoadedModel:
    """A `LoadedModel` of a REMI folder (or its `model` prefix), without its vocabulary: `dictionary.pkl` beside it
    is read by the vocabulary step every format goes through (`vocab_files.attach_vocab`). `config` and `preset`
    (the paper's TensorFlow checkpoints' options) are refused: REMI's settings are its own. `found`, `ckpt`: what
    `find_checkpoint(path)` returned and its index, when the caller has read them."""
    if config is not None or preset is not None:
        raise CheckpointError(path, "is a REMI checkpoint, whose settings are REMI's own (--config and --preset are "
                                    "for the paper's TensorFlow checkpoints)")
    found = find_checkpoint(path) if found is None else found
    if found is None:
        raise CheckpointError(path, "is not a TensorFlow checkpoint (no model.index)")
    prefix = found[0]
    ckpt = TFCheckpoint(prefix, verify_checksums=verify_checksums) if ckpt is None else ckpt
    where = ckpt.index_path
    names, arch = remi_architecture({n: e.shape for n, e in ckpt.entries.items()}, where)
    try:
        cfg = TxlConfig(
            n_token=arch["n_token"], n_layer=arch["n_layer"], n_head=arch["n_head"], d_model=arch["d_model"],
            d_head=arch["d_head"], d_inner=arch["d_inner"], d_embed=arch["d_model"], cutoffs=[], div_val=1,
            tie_weight=True, tie_projs=[False], pre_lnorm=False, untie_r=False, **REMI_SETTINGS,
            layer_norm_epsilon=KERAS_LAYER_NORM_EPSILON, ff_out_relu=True, mem_init="zeros",
        )
    except TxlError as e:
        raise CheckpointError(where, str(e)) from None
    state = to_state_dict(_Renamed(ckpt, names), arch)
    loaded = LoadedModel(cfg, state, None, FORMAT, str(prefix),
                         notes=["REMI (Pop Music Transformer): feed-forward output ReLU, layer-norm epsilon 1e-3, "
                                "and a memory that starts as mem_len attended zero vectors, as its generate does"])
    loaded.value_sources = dict(VALUE_SOURCES)
    return loaded


# Its settings are REMI's own: it takes --config and --preset only to refuse them in its own words; its
# dictionary.pkl beside the checkpoint is found by the vocabulary step.
READER = Reader(FORMAT, "the Pop Music Transformer's TensorFlow checkpoint folder (YatingMusic/remi)",
                _claims, lambda s: load_remi(s.path, config=s.config, preset=s.preset, found=found_checkpoint(s),
                                             ckpt=checkpoint_index(s)),
                location=lambda s: s.path, vocab_folder=lambda s: s.path if s.path.is_dir() else s.path.parent,
                takes=frozenset({"config", "preset"}))
