"""The Transformer-XL hyper-parameters, and the published shapes as data.

`TxlConfig` is plain data (no torch): it travels as JSON inside our checkpoint folder, in the ONNX
`metadata_props` and in TensorRT engine sidecars, so every runtime can rebuild what it needs from it.
Names follow the paper and the original code (`mem_len`, `clamp_len`, `same_length`, `div_val`, `cutoffs`).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field

from txl_deploy.errors import TxlError

# How a fresh memory starts: empty (the paper), or mem_len zero hidden states that are attended to (REMI).
MEM_INITS = ("empty", "zeros")
# Settings added after files were first written, left out of a config's dict at these defaults: every other model's
# files (and the fingerprints saved states carry) stay as they were, and older readers still open them.
LATER_DEFAULTS = {"ff_out_relu": False, "mem_init": "empty"}

# Every size fits a signed 32-bit dimension, as ONNX Runtime's and TensorRT's shapes need; a larger one is damage.
MAX_SIZE = 2**31 - 1

# Activations of one call: this many fp32 tensors of the attention-score size [B, H, Q, Q + S] are alive at once
# (scores, masks, the gathered positional terms and their int64 indices, exp); measured 1.08 GB at B 2, Q 512, S 1600.
SCORE_TENSORS = 10


@dataclass
class TxlConfig:
    n_token: int
    n_layer: int
    n_head: int
    d_model: int
    d_head: int
    d_inner: int
    d_embed: int | None = None  # defaults to d_model
    # Adaptive input / adaptive softmax. Empty cutoffs mean a plain softmax (character-level models).
    cutoffs: list[int] = field(default_factory=list)
    div_val: int = 1
    tie_weight: bool = True
    # One flag per cluster (len(cutoffs) + 1): share out_projs[i] with the embedding projection.
    tie_projs: list[bool] = field(default_factory=list)
    pre_lnorm: bool = False
    # One (r_w_bias, r_r_bias) pair per layer instead of one shared by all layers.
    untie_r: bool = False
    mem_len: int = 0
    tgt_len: int = 128
    clamp_len: int = 0  # <= 0: no clamping (the original code clamps only when clamp_len > 0)
    same_length: bool = False
    # NVIDIA's same_length lets each query see one key more than the original PyTorch code (klen - mem_len - 1);
    # so does the original TensorFlow code (mlen + 1 keys, with its always-full memory). Both are 1.
    same_length_extra: int = 0
    layer_norm_epsilon: float = 1e-5
    # The Pop Music Transformer (REMI) differs from the paper's model in two ways its weights do not show:
    # a ReLU after the feed-forward block's second layer too, LN(x + relu(W2 relu(W1 x + b1) + b2)), and a memory
    # that starts as mem_len zero hidden states that are attended to ("zeros") instead of empty ("empty").
    ff_out_relu: bool = False
    mem_init: str = "empty"

    def __post_init__(self):
        # The types first: a config comes from files (JSON, a pickle's attributes, ONNX metadata), so a list may be
        # a string and a number a list; each is refused with a TxlError rather than failing in a conversion.
        _check_types(self)
        if self.d_embed is None:
            self.d_embed = self.d_model
        self.cutoffs = [int(c) for c in self.cutoffs]
        if not self.tie_projs:
            self.tie_projs = [False] * (len(self.cutoffs) + 1)
        self.tie_projs = [bool(t) for t in self.tie_projs]
        self.validate()

    def validate(self):
        problems = []
        if not (0 < self.layer_norm_epsilon < 1):
            problems.append(f"layer_norm_epsilon must be in (0, 1), got {self.layer_norm_epsilon!r}")
        for name in ("n_token", "n_layer", "n_head", "d_model", "d_head", "d_inner", "d_embed", "div_val"):
            value = getattr(self, name)
            if not 0 < value <= MAX_SIZE:
                problems.append(f"{name} must be a positive integer at most {MAX_SIZE}, got {str(value)[:40]}")
        for name in ("mem_len", "tgt_len", "clamp_len", "same_length_extra"):
            if not -MAX_SIZE <= getattr(self, name) <= MAX_SIZE:
                problems.append(f"{name} must be at most {MAX_SIZE} in size, got {str(getattr(self, name))[:40]}")
        if self.mem_len < 0:
            problems.append(f"mem_len must be >= 0, got {self.mem_len}")
        if self.mem_init not in MEM_INITS:
            problems.append(f"mem_init must be one of {', '.join(MEM_INITS)}, got {self.mem_init!r:.40}")
        elif self.mem_init == "zeros" and self.pre_lnorm:
            # zero hidden states are zero keys and values only where qkv_net reads them unnormalised
            problems.append("mem_init 'zeros' needs pre_lnorm false")
        if list(self.cutoffs) != sorted(set(self.cutoffs)) or any(
            c <= 0 or c >= self.n_token for c in self.cutoffs
        ):
            problems.append(f"cutoffs must be increasing and inside (0, n_token={self.n_token}), got {self.cutoffs}")
        if len(self.tie_projs) != len(self.cutoffs) + 1:
            problems.append(f"tie_projs needs {len(self.cutoffs) + 1} entries (one per cluster), got {len(self.tie_projs)}")
        if self.div_val > 1 and any(self.d_embed // self.div_val**i == 0 for i in range(len(self.cutoffs) + 1)):
            problems.append(f"d_embed={self.d_embed} is too small for div_val={self.div_val}")
        if problems:
            raise TxlError("invalid Transformer-XL config: " + "; ".join(problems))

    # -- derived sizes ---------------------------------------------------------------------------------
    @property
    def n_clusters(self) -> int:
        return len(self.cutoffs)

    @property
    def adaptive(self) -> bool:
        return bool(self.cutoffs)

    def memory_bytes_per_stream(self, mem_len: int | None = None, bytes_per_value: int = 4) -> dict:
        """Bytes of recurrent state for one stream (one batch row).

        `hidden`: what the paper caches (the input of every layer, n_layer x mem_len x d_model).
        `kv_cache`: what the exported graphs cache instead (projected keys and values, 2 x n_head x d_head per
        slot), which spares each decode step the re-projection of the whole memory.
        """
        m = self.mem_len if mem_len is None else mem_len
        return {
            "hidden": self.n_layer * m * self.d_model * bytes_per_value,
            "kv_cache": self.n_layer * m * 2 * self.n_head * self.d_head * bytes_per_value,
        }

    def activation_bytes(self, batch: int, q: int, slots: int) -> int:
        """Temporaries of one call over `q` positions attending to `slots` memory slots as well (the peak of the
        exported graphs on ONNX Runtime's CPU): the attention-score-sized tensors and the feed-forward's."""
        scores = batch * self.n_head * q * (q + slots) * 4
        ff = batch * q * (self.d_inner + 4 * self.d_model) * 4
        return SCORE_TENSORS * scores + ff

    # -- serialisation ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name, default in LATER_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "TxlConfig":
        if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
            raise TxlError(f"a config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TxlError(f"unknown config keys: {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # missing required fields
            raise TxlError(f"incomplete config: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "TxlConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "TxlConfig":
        return dataclasses.replace(self, **changes)


def _is_int(v) -> bool:
    # numpy's integers are Integral too; a bool is an int to Python, never a size here
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v).__name__ != "bool_"


def _check_types(c: TxlConfig) -> None:
    problems = []
    for name in ("n_token", "n_layer", "n_head", "d_model", "d_head", "d_inner", "div_val", "mem_len", "tgt_len",
                 "clamp_len", "same_length_extra"):
        if not _is_int(getattr(c, name)):
            problems.append(f"{name} must be an integer, got {getattr(c, name)!r:.40}")
    if c.d_embed is not None and not _is_int(c.d_embed):
        problems.append(f"d_embed must be an integer, got {c.d_embed!r:.40}")
    if not isinstance(c.cutoffs, (list, tuple)) or not all(_is_int(x) for x in c.cutoffs):
        problems.append(f"cutoffs must be a list of integers, got {c.cutoffs!r:.60}")
    if not isinstance(c.tie_projs, (list, tuple)) or not all(isinstance(x, numbers.Integral) for x in c.tie_projs):
        problems.append(f"tie_projs must be a list of booleans, got {c.tie_projs!r:.60}")
    for name in ("tie_weight", "pre_lnorm", "untie_r", "same_length", "ff_out_relu"):
        if not isinstance(getattr(c, name), numbers.Integral):
            problems.append(f"{name} must be true or false, got {getattr(c, name)!r:.40}")
    if not isinstance(c.mem_init, str):
        problems.append(f"mem_init must be a string, got {c.mem_init!r:.40}")
    if not isinstance(c.layer_norm_epsilon, numbers.Real) or isinstance(c.layer_norm_epsilon, bool):
        problems.append(f"layer_norm_epsilon must be a number, got {c.layer_norm_epsilon!r:.40}")
    if problems:
        raise TxlError("invalid Transformer-XL config: " + "; ".join(problems))


# The published shapes (Dai et al. 2019, Table and the original run scripts; the music models' own code), as in
# gpt-fast's ModelArgs registry: tests and benchmarks build random-weight stand-ins of these.
PUBLISHED_SHAPES: dict[str, dict] = {
    "wt103-base": dict(
        n_token=267735, n_layer=16, n_head=10, d_model=410, d_head=41, d_inner=2100,
        cutoffs=[20000, 40000, 200000], div_val=1, tie_weight=True, tie_projs=[False, True, True, True],
        mem_len=640, tgt_len=64, clamp_len=400, same_length=True,
    ),
    "wt103-large": dict(
        n_token=267735, n_layer=18, n_head=16, d_model=1024, d_head=64, d_inner=4096,
        cutoffs=[20000, 40000, 200000], div_val=4, tie_weight=True, tie_projs=[False, True, True, True],
        mem_len=1600, tgt_len=128, clamp_len=1000, same_length=True,
    ),
    "enwik8-base": dict(
        n_token=204, n_layer=12, n_head=8, d_model=512, d_head=64, d_inner=2048,
        mem_len=2100, tgt_len=80, clamp_len=820,
    ),
    "enwik8-large": dict(
        n_token=204, n_layer=24, n_head=8, d_model=1024, d_head=128, d_inner=3072,
        mem_len=3800, tgt_len=128, clamp_len=1000,
    ),
    # The Pop Music Transformer (github:YatingMusic/remi, model.py's hard-coded settings and modules.py): Keras
    # layer norms (epsilon 1e-3), a ReLU after the feed-forward block's second layer, a memory of mem_len zero
    # vectors. Its dictionary.pkl is built from its data and ships only with the checkpoint download; n_token is
    # the REMI-tempo event set utils.py's bins allow: Bar 1, Position 16, Note Velocity 32, Note On 128,
    # Note Duration 64, Tempo Class 3, Tempo Value 60.
    "remi": dict(
        n_token=304, n_layer=12, n_head=8, d_model=512, d_head=64, d_inner=2048,
        mem_len=512, tgt_len=512, clamp_len=-1, same_length=False,
        layer_norm_epsilon=1e-3, ff_out_relu=True, mem_init="zeros",
    ),
    # Compound Word Transformer's remi-xl (github:YatingMusic/compound-word-transformer,
    # workspace/uncond/remi-xl/config.yml; its published ep_170.pth.tar): 332 events, an output layer with a bias,
    # not tied to the embedding (tie_weight off), pre_lnorm and same_length on, nn.LayerNorm's epsilon.
    "remi-xl": dict(
        n_token=332, n_layer=12, n_head=8, d_model=512, d_head=64, d_inner=2048, tie_weight=False,
        pre_lnorm=True, mem_len=512, tgt_len=70, clamp_len=-1, same_length=True,
    ),
}


def published_config(name: str, **overrides) -> TxlConfig:
    if name not in PUBLISHED_SHAPES:
        raise TxlError(f"unknown shape {name!r}; known: {', '.join(PUBLISHED_SHAPES)}")
    return TxlConfig(**{**PUBLISHED_SHAPES[name], **overrides})
