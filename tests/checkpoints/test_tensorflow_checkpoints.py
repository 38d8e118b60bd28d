"""The original TensorFlow checkpoints: our bundle reader against TensorFlow, the name/shape mapping, presets, the
corpus cache, and log-probabilities against a NumPy implementation of the original TensorFlow equations.

The fixtures are tiny checkpoints written by TensorFlow itself (`tensorflow-cpu`, a test-only oracle) with the
variable names and shapes of the original `tf/model.py`, saved by `tf.compat.v1.train.Saver` (V2 format) as the
original `train_gpu.py` does. TensorFlow is imported once and all fixtures share one graph and one session.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import sys
import types
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest

# The oracle of every test here, imported with the module (a missing or broken install fails them, never skips:
# tensorflow-cpu is in the test extra).
import tensorflow as tf
from helpers.cli import assert_one_line_error, cli
from helpers.file_reads import count_reads

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.tensorflow.architecture import infer_architecture
from txl_deploy.checkpoints.tensorflow.bundle import TFCheckpoint, crc32c
from txl_deploy.checkpoints.tensorflow.presets import PRESETS, eval_settings, matching_presets
from txl_deploy.checkpoints.vocab_files import read_vocab_file
from txl_deploy.errors import CheckpointError
from txl_deploy.runtimes import TxlRuntime

# Training flags of each fixture (tf/train_gpu.py names) plus the vocabulary and cutoffs corpus-info.json holds.
# emb_std: small embeddings make the first layer norm see a small variance, where TF's epsilon (1e-12) and
# PyTorch's (1e-5) differ far beyond the 1e-5 tolerance.
FIXTURES = {
    # adaptive softmax, div_val > 1, untie_r, projections shared (the wt103 layout), TF's same_length window
    "adaptive-shared": dict(n_layer=2, d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=24, div_val=2,
                            untie_r=True, proj_share_all_but_first=True, proj_same_dim=True, n_token=23,
                            cutoffs=[7, 13], tgt_len=4, mem_len=5, clamp_len=6, same_length=True, py2=True),
    # no projection sharing and proj_same_dim False (the lm1b layout): cutoff_0 has no projection at all
    "adaptive-unshared": dict(n_layer=2, d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=24, div_val=2,
                              untie_r=True, proj_share_all_but_first=False, proj_same_dim=False, n_token=23,
                              cutoffs=[7, 13], tgt_len=3, mem_len=4, clamp_len=-1, same_length=False,
                              emb_std=0.01),
    # full softmax with shared r-biases (the enwik8 / text8 layout)
    "full-softmax": dict(n_layer=3, d_model=16, d_embed=16, n_head=4, d_head=4, d_inner=20, div_val=1,
                         untie_r=False, proj_share_all_but_first=False, proj_same_dim=True, n_token=11, cutoffs=[],
                         tgt_len=4, mem_len=6, clamp_len=-1, same_length=True, emb_std=0.01),
    # div_val 1 with cutoffs and d_embed != d_model, untied projections (one softmax proj per cluster)
    "div1-projected": dict(n_layer=2, d_model=16, d_embed=12, n_head=2, d_head=8, d_inner=24, div_val=1,
                           untie_r=False, proj_share_all_but_first=False, proj_same_dim=True, n_token=19,
                           cutoffs=[9], tgt_len=4, mem_len=5, clamp_len=3, same_length=True),
}
SHAPE_AND_EVAL_FLAGS = ("n_layer", "d_model", "d_embed", "n_head", "d_head", "d_inner", "div_val", "untie_r",
                        "proj_share_all_but_first", "proj_same_dim", "tgt_len", "mem_len", "clamp_len",
                        "same_length")


def tie_projs_of(spec) -> list[bool]:
    # tf/train_gpu.py: all but the first cluster share when proj_share_all_but_first
    n = len(spec["cutoffs"]) + 1
    return [False] + [bool(spec["proj_share_all_but_first"])] * (n - 1)


def tf_variable_shapes(spec) -> dict:
    """{original variable name: shape} for training flags `spec`, as tf/model.py creates them."""
    L, D, H, Dh, Di = spec["n_layer"], spec["d_model"], spec["n_head"], spec["d_head"], spec["d_inner"]
    E, V, cutoffs, div_val = spec["d_embed"], spec["n_token"], spec["cutoffs"], spec["div_val"]
    t = "transformer/"
    shapes = {t + "r_w_bias": [L, H, Dh] if spec["untie_r"] else [H, Dh]}
    shapes[t + "r_r_bias"] = shapes[t + "r_w_bias"]
    ends = [0] + cutoffs + [V]
    if div_val == 1:
        shapes[t + "adaptive_embed/lookup_table"] = [V, E]
        if D != E:
            shapes[t + "adaptive_embed/proj_W"] = [E, D]
    else:
        for i in range(len(ends) - 1):
            d_i = E // div_val**i
            shapes[t + f"adaptive_embed/cutoff_{i}/lookup_table"] = [ends[i + 1] - ends[i], d_i]
            if not (D == d_i and not spec["proj_same_dim"]):
                shapes[t + f"adaptive_embed/cutoff_{i}/proj_W"] = [d_i, D]
    for i in range(L):
        p = t + f"layer_{i}/"
        shapes.update({p + "rel_attn/qkv/kernel": [D, 3 * H * Dh], p + "rel_attn/r/kernel": [D, H * Dh],
                       p + "rel_attn/o/kernel": [H * Dh, D], p + "rel_attn/LayerNorm/gamma": [D],
                       p + "rel_attn/LayerNorm/beta": [D], p + "ff/layer_1/kernel": [D, Di],
                       p + "ff/layer_1/bias": [Di], p + "ff/layer_2/kernel": [Di, D], p + "ff/layer_2/bias": [D],
                       p + "ff/LayerNorm/gamma": [D], p + "ff/LayerNorm/beta": [D]})
    if not cutoffs:
        shapes[t + "adaptive_softmax/bias"] = [V]
    else:
        tie = tie_projs_of(spec)
        for i in range(len(ends) - 1):
            d_i = E // div_val**i
            shapes[t + f"adaptive_softmax/cutoff_{i}/b"] = [ends[i + 1] - ends[i]]
            if not tie[i] and not ((div_val == 1 or not spec["proj_same_dim"]) and D == d_i):
                shapes[t + f"adaptive_softmax/cutoff_{i}/proj"] = [d_i, D]
        shapes[t + "adaptive_softmax/cutoff_0/cluster_W"] = [len(cutoffs), E]
        shapes[t + "adaptive_softmax/cutoff_0/cluster_b"] = [len(cutoffs)]
    return shapes


def random_weights(spec, seed) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tf_variable_shapes(spec).items():
        if name.endswith("LayerNorm/gamma"):
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("lookup_table"):
            value = spec.get("emb_std", 0.5) * rng.standard_normal(shape)
        else:
            value = 0.3 * rng.standard_normal(shape)
        out[name] = value.astype(np.float32)
    return out


# -- the independent reference: the original TensorFlow equations in NumPy (float64) --------------------------
def _layer_norm(x, gamma, beta, eps=1e-12):  # tf.contrib.layers.layer_norm
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _create_mask(qlen, mlen, same_length):
    # tf/model.py _create_mask, with matrix_band_part(ones, 0, -1) = triu, (-1, 0) = tril, (0, 0) = diagonal
    ones = np.ones((qlen, qlen))
    mask_u, mask_dia = np.triu(ones), np.eye(qlen)
    ret = np.concatenate([np.zeros((qlen, mlen)), mask_u - mask_dia], 1)
    if same_length:
        mask_l = np.tril(ones)
        ret = np.concatenate([ret[:, :qlen] + mask_l - mask_dia, ret[:, qlen:]], 1)
    return ret


def _rel_shift(x):  # [qlen, klen, n_head] (batch of one)
    q, k, n = x.shape
    x = np.pad(x, [(0, 0), (1, 0), (0, 0)])
    return x.reshape(k + 1, q, n)[1:].reshape(q, k, n)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def tf_reference_log_probs(w, spec, tokens) -> np.ndarray:
    """Log-probabilities [len(tokens), n_token] of one stream, as TensorFlow's evaluation computes them: segments
    of tgt_len, a memory of mem_len zero vectors at the start, the TF mask, epsilon 1e-12, HF's cluster order."""
    w = {k[len("transformer/"):]: v.astype(np.float64) for k, v in w.items()}
    L, D, H, Dh = spec["n_layer"], spec["d_model"], spec["n_head"], spec["d_head"]
    V, cutoffs, div_val, E = spec["n_token"], spec["cutoffs"], spec["div_val"], spec["d_embed"]
    mem_len, clamp_len = spec["mem_len"], spec["clamp_len"]
    ends = [0] + cutoffs + [V]
    mems = [np.zeros((mem_len, D)) for _ in range(L)]
    out = []
    for start in range(0, len(tokens), spec["tgt_len"]):
        x = np.asarray(tokens[start:start + spec["tgt_len"]])
        qlen, mlen = len(x), mem_len
        klen = qlen + mlen
        if div_val == 1:
            emb = w["adaptive_embed/lookup_table"][x]
            if "adaptive_embed/proj_W" in w:
                emb = emb @ w["adaptive_embed/proj_W"]
        else:
            emb = np.zeros((qlen, D))
            for i in range(len(ends) - 1):
                m = (x >= ends[i]) & (x < ends[i + 1])
                y = w[f"adaptive_embed/cutoff_{i}/lookup_table"][x[m] - ends[i]]
                if f"adaptive_embed/cutoff_{i}/proj_W" in w:
                    y = y @ w[f"adaptive_embed/cutoff_{i}/proj_W"]
                emb[m] = y
        h = emb * D**0.5
        mask = _create_mask(qlen, mlen, spec["same_length"])[:, :, None]
        pos_seq = np.arange(klen - 1, -1, -1.0)
        if clamp_len > 0:
            pos_seq = np.minimum(pos_seq, clamp_len)
        inv_freq = 1 / (10000 ** (np.arange(0, D, 2.0) / D))
        sin_inp = pos_seq[:, None] * inv_freq[None]
        pos_emb = np.concatenate([np.sin(sin_inp), np.cos(sin_inp)], -1)
        new_mems = []
        for i in range(L):
            new_mems.append(np.concatenate([mems[i], h])[-mem_len:])
            p = f"layer_{i}/"
            r_w = w["r_w_bias"][i] if spec["untie_r"] else w["r_w_bias"]
            r_r = w["r_r_bias"][i] if spec["untie_r"] else w["r_r_bias"]
            cat = np.concatenate([mems[i], h])
            heads = cat @ w[p + "rel_attn/qkv/kernel"]
            q, k, v = np.split(heads, 3, -1)
            q = q[-qlen:].reshape(qlen, H, Dh)
            k, v = k.reshape(klen, H, Dh), v.reshape(klen, H, Dh)
            r_k = (pos_emb @ w[p + "rel_attn/r/kernel"]).reshape(klen, H, Dh)
            ac = np.einsum("ind,jnd->ijn", q + r_w, k)
            bd = _rel_shift(np.einsum("ind,jnd->ijn", q + r_r, r_k))
            score = (ac + bd) / Dh**0.5
            score = score * (1 - mask) - 1e30 * mask
            prob = np.exp(score - score.max(1, keepdims=True))
            prob /= prob.sum(1, keepdims=True)
            vec = np.einsum("ijn,jnd->ind", prob, v).reshape(qlen, H * Dh)
            h = _layer_norm(vec @ w[p + "rel_attn/o/kernel"] + h, w[p + "rel_attn/LayerNorm/gamma"],
                            w[p + "rel_attn/LayerNorm/beta"])
            ff = np.maximum(h @ w[p + "ff/layer_1/kernel"] + w[p + "ff/layer_1/bias"], 0)
            ff = ff @ w[p + "ff/layer_2/kernel"] + w[p + "ff/layer_2/bias"]
            h = _layer_norm(ff + h, w[p + "ff/LayerNorm/gamma"], w[p + "ff/LayerNorm/beta"])
        mems = new_mems
        out.append(_tf_softmax(w, spec, h, ends, E, div_val))
    return np.concatenate(out)


def _tf_softmax(w, spec, h, ends, E, div_val):
    def logit(x, W, b, proj):  # mask_adaptive_logsoftmax's _logit
        if proj is not None:
            x = np.einsum("id,ed->ie", x, proj)
        return np.einsum("id,nd->in", x, W) + b

    D = spec["d_model"]
    if not spec["cutoffs"]:
        return _log_softmax(logit(h, w["adaptive_embed/lookup_table"], w["adaptive_softmax/bias"],
                                  w.get("adaptive_embed/proj_W")))
    tie = tie_projs_of(spec)
    result = np.zeros((h.shape[0], ends[-1]))
    head = None
    for i in range(len(ends) - 1):
        lo, hi = ends[i], ends[i + 1]
        d_i = E // div_val**i
        W = w["adaptive_embed/lookup_table"][lo:hi] if div_val == 1 else w[f"adaptive_embed/cutoff_{i}/lookup_table"]
        b = w[f"adaptive_softmax/cutoff_{i}/b"]
        if tie[i]:
            proj = w.get("adaptive_embed/proj_W") if div_val == 1 else w.get(f"adaptive_embed/cutoff_{i}/proj_W")
        elif (div_val == 1 or not spec["proj_same_dim"]) and D == d_i:
            proj = None
        else:
            proj = w[f"adaptive_softmax/cutoff_{i}/proj"]
        if i == 0:
            W = np.concatenate([W, w["adaptive_softmax/cutoff_0/cluster_W"]])
            b = np.concatenate([b, w["adaptive_softmax/cutoff_0/cluster_b"]])
            head = _log_softmax(logit(h, W, b, proj))
            result[:, lo:hi] = head[:, : hi - lo]
        else:
            tail = _log_softmax(logit(h, W, b, proj))
            result[:, lo:hi] = tail + head[:, ends[1] + i - 1][:, None]
    return result


# -- corpus caches ----------------------------------------------------------------------------------------
def py3_cache_pickle(symbols, dataset, cutoffs) -> bytes:
    """A cache.pkl as a Python 3 run of the original data_utils.py writes it (protocol 2, numpy splits)."""
    mods = {name: types.ModuleType(name) for name in ("data_utils", "vocabulary")}

    class Corpus:
        pass

    class Vocab:
        pass

    for cls, mod in ((Corpus, "data_utils"), (Vocab, "vocabulary")):
        cls.__module__, cls.__qualname__ = mod, cls.__name__
        setattr(mods[mod], cls.__name__, cls)
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    try:
        vocab = Vocab()
        vocab.__dict__.update(counter=Counter({s: 3 for s in symbols}), special=[], min_freq=0, max_size=None,
                              lower_case=False, delimiter=None, vocab_file=None, idx2sym=list(symbols),
                              sym2idx=OrderedDict((s, i) for i, s in enumerate(symbols)))
        corpus = Corpus()
        corpus.__dict__.update(dataset=dataset, vocab=vocab, train=np.arange(12, dtype=np.int64),
                               valid=np.arange(5, dtype=np.int64), test=np.arange(5, dtype=np.int64),
                               cutoffs=[0] + cutoffs + [len(symbols)] if cutoffs else [])
        return pickle.dumps(corpus, protocol=2)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def py2_cache_pickle(symbols, dataset) -> bytes:
    """A cache.pkl as Python 2 writes it: protocol 2, the corpus class pickled as `__main__.Corpus` (data_utils.py
    run as a script), str objects as byte strings (SHORT_BINSTRING), OrderedDict/Counter by REDUCE."""
    def s(text: str) -> bytes:
        raw = text.encode("utf-8")
        assert len(raw) < 256
        return b"U" + bytes([len(raw)]) + raw

    out = bytearray(b"\x80\x02")
    out += b"c__main__\nCorpus\n)\x81}("
    out += s("dataset") + s(dataset)
    out += s("vocab") + b"cvocabulary\nVocab\n)\x81}("
    out += s("idx2sym") + b"](" + b"".join(s(x) for x in symbols) + b"e"
    out += s("sym2idx") + b"ccollections\nOrderedDict\n](" + b"".join(
        b"](" + s(x) + b"K" + bytes([i]) + b"e" for i, x in enumerate(symbols)) + b"e\x85R"
    out += s("counter") + b"ccollections\nCounter\n}(" + b"".join(s(x) + b"K\x02" for x in symbols) + b"u\x85R"
    out += s("special") + b"]" + s("lower_case") + b"\x89"
    out += b"ub"  # SETITEMS, BUILD of the Vocab
    out += s("cutoffs") + b"]"
    out += b"ub."
    return bytes(out)


def symbols_for(spec) -> list[str]:
    words = ["<eos>", "the", "café", "naïve", "of", "and", "to", "a", "in", "was", "on"]
    return (words + [f"w{i}" for i in range(spec["n_token"])])[: spec["n_token"]]


# -- writing the fixtures with TensorFlow -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tf_session():
    graph = tf.Graph()
    with graph.as_default():
        sess = tf.compat.v1.Session(graph=graph)
    yield graph, sess
    sess.close()


def save_with_saver(tf_session, weights: dict, prefix: Path, extra_slots=True):
    """Variables with the original names, saved as the original train_gpu.py does (Saver, V2, global_step)."""
    graph, sess = tf_session
    with graph.as_default():
        tag = f"v{len(graph.get_operations())}"
        var_list = {}
        for n, (name, value) in enumerate(weights.items()):
            var_list[name] = tf.compat.v1.Variable(value, name=f"{tag}_{n}")
        var_list["global_step"] = tf.compat.v1.Variable(np.int64(0), name=f"{tag}_step")
        if extra_slots:  # Adam's slots and powers, as a training checkpoint has them
            first = next(iter(weights))
            var_list[first + "/Adam"] = tf.compat.v1.Variable(np.zeros_like(weights[first]), name=f"{tag}_a")
            var_list[first + "/Adam_1"] = tf.compat.v1.Variable(np.zeros_like(weights[first]), name=f"{tag}_b")
            var_list["beta1_power"] = tf.compat.v1.Variable(np.float32(0.9), name=f"{tag}_p")
        sess.run(tf.compat.v1.variables_initializer(list(var_list.values())))
        saver = tf.compat.v1.train.Saver(var_list=var_list, write_version=tf.compat.v1.train.SaverDef.V2)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        return Path(saver.save(sess, str(prefix), global_step=0))


@pytest.fixture(scope="module")
def published(tf_session, tmp_path_factory):
    """{fixture name: (folder laid out like pretrained_xl/tf_<name>/, weights, spec)}."""
    out = {}
    for n, (name, spec) in enumerate(FIXTURES.items()):
        root = tmp_path_factory.mktemp(f"tf_{name}")
        weights = random_weights(spec, seed=n)
        save_with_saver(tf_session, weights, root / "model" / "model.ckpt")
        (root / "data").mkdir()
        symbols = symbols_for(spec)
        cache = (py2_cache_pickle(symbols, name) if spec.get("py2")
                 else py3_cache_pickle(symbols, name, spec["cutoffs"]))
        (root / "data" / "cache.pkl").write_bytes(cache)
        info = {"vocab_size": spec["n_token"], "dataset": name,
                "cutoffs": [0] + spec["cutoffs"] + [spec["n_token"]] if spec["cutoffs"] else []}
        (root / "data" / "corpus-info.json").write_text(json.dumps(info))
        flags = {k: spec[k] for k in SHAPE_AND_EVAL_FLAGS}
        flags.update(dropout=0.1, learning_rate=2.5e-4, train_batch_size=8)  # training-only flags are accepted
        (root / "flags.json").write_text(json.dumps(flags))
        out[name] = (root, weights, spec)
    return out


# -- the bundle reader against TensorFlow --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FIXTURES))
def test_reader_matches_tensorflow(published, name):
    root = published[name][0]
    prefix = root / "model" / "model.ckpt-0"
    reader = tf.train.load_checkpoint(str(prefix))
    theirs = reader.get_variable_to_dtype_map()
    ours = TFCheckpoint(prefix)
    assert set(ours.names()) == set(theirs)
    for var in theirs:
        expected = reader.get_tensor(var)
        got = ours.get_tensor(var)
        assert got.dtype == np.asarray(expected).dtype, var
        assert got.shape == np.asarray(expected).shape and np.array_equal(got, expected), var


def test_reader_dtypes_and_shards(tf_session, tmp_path):
    """float16, bfloat16, float64, int32, int64 and bool tensors, in a bundle of two data shards (TensorFlow's
    sharded save: per-shard SaveV2, then MergeV2Checkpoints)."""
    graph, sess = tf_session
    rng = np.random.default_rng(7)
    parts = [
        {"a/half": rng.standard_normal((3, 5)).astype(np.float16), "a/step": np.int64(123456789012),
         "a/ints": np.arange(-4, 8, dtype=np.int32).reshape(3, 4)},
        {"b/bf16": rng.standard_normal((4, 6)).astype(np.float32), "b/double": rng.standard_normal(7),
         "b/flags": np.array([True, False, True]), "b/big": rng.standard_normal((300, 70)).astype(np.float32)},
    ]
    with graph.as_default():
        ops = []
        for k, part in enumerate(parts):
            tensors = []
            for name, value in part.items():
                t = tf.constant(value)
                tensors.append(tf.cast(t, tf.bfloat16) if name.endswith("bf16") else t)
            ops.append(tf.raw_ops.SaveV2(prefix=str(tmp_path / f"part{k}"), tensor_names=list(part),
                                         shape_and_slices=[""] * len(part), tensors=tensors))
        sess.run(ops)
        sess.run(tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=[str(tmp_path / "part0"),
                                                                    str(tmp_path / "part1")],
                                               destination_prefix=str(tmp_path / "merged")))
    assert sorted(p.name for p in tmp_path.glob("merged.data-*")) == ["merged.data-00000-of-00002",
                                                                       "merged.data-00001-of-00002"]
    reader = tf.train.load_checkpoint(str(tmp_path / "merged"))
    ours = TFCheckpoint(tmp_path / "merged")
    assert ours.num_shards == 2
    assert set(ours.names()) == set(reader.get_variable_to_shape_map())
    for name in ours.names():
        expected = np.asarray(reader.get_tensor(name))
        got = ours.get_tensor(name)
        if name.endswith("bf16"):  # bfloat16 is widened to float32, exactly
            assert got.dtype == np.float32
            expected = expected.astype(np.float32)
        else:
            assert got.dtype == expected.dtype, name
        assert np.array_equal(got, expected), name


def test_crc32c_known_value():
    # the check value of CRC-32C (Castagnoli) for "123456789"; the lane-parallel path agrees with the bytewise one
    assert crc32c(b"123456789") == 0xE3069283
    data = np.random.default_rng(0).integers(0, 256, (1 << 17) + 11, dtype=np.uint8).tobytes()
    from txl_deploy.checkpoints.tensorflow.bundle import _crc_register

    assert crc32c(data) == _crc_register(data, 0xFFFFFFFF) ^ 0xFFFFFFFF


@pytest.mark.parametrize("damage", ["truncate-data", "flip-data", "truncate-index", "flip-index", "no-data"])
def test_damaged_checkpoint_is_one_line_error_naming_the_file(published, tmp_path, damage):
    root = tmp_path / "copy"
    shutil.copytree(published["adaptive-shared"][0], root)
    data = root / "model" / "model.ckpt-0.data-00000-of-00001"
    index = root / "model" / "model.ckpt-0.index"
    target = data if "data" in damage else index
    raw = bytearray(target.read_bytes())
    if damage == "no-data":
        data.unlink()
    elif damage.startswith("truncate"):
        target.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        raw[len(raw) // 3] ^= 0x40
        target.write_bytes(bytes(raw))
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--config", root / "flags.json"), target)
    assert not (tmp_path / "out").exists()


# -- convert + export against the TensorFlow equations --------------------------------------------------------
def stream_for(spec, n_segments, seed=0):
    # every cluster appears: a random stream over the whole vocabulary
    rng = np.random.default_rng(100 + seed)
    return rng.integers(0, spec["n_token"], n_segments * spec["tgt_len"] - 1).astype(np.int64)


def onnx_zero_memory_log_probs(onnx_path, cfg, mem_len, tokens, tgt_len):
    """Run the exported graph (full state) from TensorFlow's first memory: mem_len zero vectors, all attended
    (every slot valid, i.e. mem_count = mem_len; a zero hidden state projects to zero keys and values)."""
    import onnxruntime as ort

    from txl_deploy.contract.io_spec import GraphSpec

    spec = GraphSpec(cfg.n_layer, cfg.n_head, cfg.d_head, mem_len, cfg.n_token, "full")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    state = {}
    for s in spec.state_inputs():
        state[s.name] = np.zeros(s.shape_for(1), dtype=np.int64 if s.dtype == "int64" else np.float32)
    state["mem_count"][:] = mem_len
    out = []
    pairing = spec.pairing()
    for start in range(0, len(tokens), tgt_len):
        seg = tokens[start:start + tgt_len][None]
        feed = {"tokens": seg, "out_positions": np.arange(seg.shape[1], dtype=np.int64)[None], **state}
        results = dict(zip(spec.output_names(), sess.run(spec.output_names(), feed)))
        out.append(results["log_probs"][0])
        state = {name: results[pairing[name]] for name in state}
    return np.concatenate(out)


@pytest.mark.parametrize("name", list(FIXTURES))
def test_convert_export_matches_tensorflow_equations(published, tmp_path, name):
    from txl_deploy.exporters.onnx.export import export_onnx

    root, weights, spec = published[name]
    out = tmp_path / "converted"
    result = cli("convert", root, "-o", out, "--config", root / "flags.json")
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "config.json").read_text())
    cfg_d = meta["config"]
    # TF's window and epsilon, and the evaluation settings of the training flags
    assert cfg_d["same_length_extra"] == 1 and cfg_d["layer_norm_epsilon"] == 1e-12
    for key in ("tgt_len", "mem_len", "clamp_len", "same_length", "n_layer", "d_model", "n_head", "d_head",
                "d_inner", "div_val", "untie_r"):
        assert cfg_d[key] == spec[key], key
    assert cfg_d["cutoffs"] == spec["cutoffs"] and cfg_d["n_token"] == spec["n_token"]
    sources = meta["source"]["config_sources"]
    assert sources["mem_len"].startswith("--config") and sources["n_layer"] == "checkpoint shapes"
    assert meta["source"]["format"] == "tensorflow"
    vocab = json.loads((out / "vocab.json").read_text())
    assert vocab["symbols"] == symbols_for(spec)  # UTF-8 symbols intact, from either pickle

    loaded = load_model(out)
    onnx_path = tmp_path / "model.onnx"
    export_onnx(loaded, onnx_path, state="full", max_segment=8)  # verified vs PyTorch
    tokens = stream_for(spec, n_segments=6)
    reference = tf_reference_log_probs(weights, spec, tokens)
    got = onnx_zero_memory_log_probs(onnx_path, loaded.config, spec["mem_len"], tokens, spec["tgt_len"])
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)

    # Our default semantics (an empty first memory) reach the same numbers once the zeros have left every layer's
    # memory: after n_layer * ceil(mem_len / tgt_len) segments.
    import torch

    model = loaded.build()
    warm = spec["n_layer"] * math.ceil(spec["mem_len"] / spec["tgt_len"])
    tokens = stream_for(spec, n_segments=warm + 2, seed=1)
    reference = tf_reference_log_probs(weights, spec, tokens)
    mems, pieces = None, []
    with torch.no_grad():
        for start in range(0, len(tokens), spec["tgt_len"]):
            lp, mems = model(torch.from_numpy(tokens[start:start + spec["tgt_len"]])[None], mems)
            pieces.append(lp[0].numpy())
    ours = np.concatenate(pieces)
    skip = warm * spec["tgt_len"]
    np.testing.assert_allclose(ours[skip:], reference[skip:], atol=1e-5, rtol=0)


def test_checkpoint_path_with_vocab(published, tmp_path):
    root, _, spec = published["full-softmax"]
    elsewhere = tmp_path / "ckpt"
    shutil.copytree(root / "model", elsewhere)  # no data/ beside it
    prefix = elsewhere / "model.ckpt-0"
    with pytest.raises(CheckpointError, match="no vocabulary"):
        load_model(prefix, config=root / "flags.json").require_vocab()
    loaded = load_model(prefix, config=root / "flags.json", vocab=root / "data" / "cache.pkl")
    assert loaded.source_format == "tensorflow" and loaded.vocab.symbols == symbols_for(spec)
    assert loaded.config.mem_len == spec["mem_len"]


def test_each_file_is_read_once_though_two_readers_look(published, monkeypatch):
    """REMI's reader looks at every TensorFlow checkpoint's index before the paper's reader claims it: the
    `checkpoint` file and the index are read once."""
    root = published["full-softmax"][0]
    reads = count_reads(monkeypatch)
    assert load_model(root, config=root / "flags.json").source_format == "tensorflow"
    assert (reads["checkpoint"], reads["model.ckpt-0.index"], reads["flags.json"]) == (1, 1, 1)


# -- presets and flags -----------------------------------------------------------------------------------------
PUBLISHED_FLAGS = {
    "enwik8-large": dict(n_token=204, cutoffs=[]),
    "text8-large": dict(n_token=27, cutoffs=[]),
    "wt103-large": dict(n_token=267735, cutoffs=[20000, 40000, 200000]),
    "lm1b-large": dict(n_token=793470, cutoffs=[60000, 100000, 640000]),
}


@pytest.mark.parametrize("preset", list(PUBLISHED_FLAGS))
def test_published_shapes_pick_their_preset(preset):
    spec = {**PRESETS[preset], **PUBLISHED_FLAGS[preset]}
    shapes = tf_variable_shapes(spec)
    if preset == "lm1b-large":  # proj_same_dim False: the first cluster has no projection on either side
        assert "transformer/adaptive_embed/cutoff_0/proj_W" not in shapes
        assert "transformer/adaptive_softmax/cutoff_0/proj" not in shapes
    arch = infer_architecture(shapes)
    for key in ("n_layer", "d_model", "n_head", "d_head", "d_inner", "div_val", "untie_r", "n_token", "cutoffs"):
        assert arch[key] == spec[key], key
    candidates = matching_presets(arch)
    if preset in ("enwik8-large", "text8-large"):
        assert candidates == ["enwik8-large", "text8-large"]  # same shapes; corpus-info.json's dataset decides
        settings, sources = eval_settings(arch, None, None, None, preset.split("-")[0], "x")
        assert sources["_preset"] == preset
        with pytest.raises(CheckpointError, match=r"several presets \(enwik8-large, text8-large\); pass --preset"):
            eval_settings(arch, None, None, None, None, "x")
    else:
        assert candidates == [preset]
        settings, sources = eval_settings(arch, None, None, None, None, "x")
    assert settings == {k: PRESETS[preset][k] for k in ("tgt_len", "mem_len", "clamp_len", "same_length")}
    assert "paper's evaluation script" in sources["mem_len"]


def test_tiny_checkpoint_fits_no_preset(published, tmp_path):
    root = published["adaptive-shared"][0]
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out"), "fit none of the presets", "--config")
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--preset", "wt103-large"),
                          "does not fit preset wt103-large: n_layer=18 but the checkpoint's shapes say 2")


def test_config_flags_are_checked_against_shapes(published, tmp_path):
    root, _, spec = published["adaptive-unshared"]
    flags = json.loads((root / "flags.json").read_text())
    bad = tmp_path / "flags.json"
    bad.write_text(json.dumps({**flags, "d_inner": 99}))
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--config", bad),
                          "d_inner=99 but the checkpoint's shapes say 24")
    bad.write_text(json.dumps({**flags, "proj_same_dim": True}))
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--config", bad), "proj_same_dim=True")
    bad.write_text(json.dumps({**flags, "n_layers": 2}))
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--config", bad),
                          "unknown training flags: n_layers")


def test_unsupported_names_and_shapes_name_the_variable():
    spec = FIXTURES["adaptive-shared"]
    shapes = tf_variable_shapes(spec)
    with pytest.raises(CheckpointError, match="'transformer/layer_1/rel_attn/qkv/bias' is not part of"):
        infer_architecture({**shapes, "transformer/layer_1/rel_attn/qkv/bias": [48]})
    with pytest.raises(CheckpointError, match=r"'transformer/layer_1/ff/layer_2/kernel' has shape \[24, 15\]"):
        infer_architecture({**shapes, "transformer/layer_1/ff/layer_2/kernel": [24, 15]})
    missing = dict(shapes)
    del missing["transformer/adaptive_embed/cutoff_1/proj_W"]
    with pytest.raises(CheckpointError, match="'transformer/adaptive_embed/cutoff_1/proj_W' is missing"):
        infer_architecture(missing)
    # global_step and Adam slots are not weights and are ignored
    extra = {**shapes, "global_step": [], "transformer/r_w_bias/Adam": [2, 2, 8], "beta2_power": []}
    assert infer_architecture(extra)["n_layer"] == 2


def test_corpus_info_is_cross_checked(published, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(published["adaptive-shared"][0], root)
    info = root / "data" / "corpus-info.json"
    info.write_text(json.dumps({"vocab_size": 23, "cutoffs": [0, 7, 14, 23], "dataset": "x"}))
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--config", root / "flags.json"), info,
                          "cutoffs [0, 7, 14, 23]")
    info.write_text(json.dumps({"vocab_size": 30, "cutoffs": [], "dataset": "x"}))
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--config", root / "flags.json"),
                          "vocab_size 30")


def test_malicious_cache_pkl_is_refused_and_nothing_runs(published, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(published["full-softmax"][0], root)
    marker = tmp_path / "marker"
    # protocol 0: os.system("touch <marker>") by REDUCE
    evil = b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR."
    (root / "data" / "cache.pkl").write_bytes(evil)
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "out", "--config", root / "flags.json"),
                          "refused to unpickle", "system")
    assert not marker.exists() and not (tmp_path / "out").exists()
    # a global hidden inside the vocabulary is refused as well
    evil = py2_cache_pickle(["a", "b"], "x").replace(b"ccollections\nCounter\n", b"cbuiltins\neval\n")
    (root / "data" / "cache.pkl").write_bytes(evil)
    with pytest.raises(CheckpointError, match="refused to unpickle builtins.eval"):
        read_vocab_file(root / "data" / "cache.pkl")


def test_info_and_tf_semantics_for_other_formats(published, tmp_path):
    root = published["full-softmax"][0]
    result = cli("info", root, "--config", root / "flags.json", "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["format"] == "tensorflow" and d["config"]["layer_norm_epsilon"] == 1e-12
    assert d["config_sources"]["mem_len"].startswith("--config")
    assert d["config_sources"]["d_model"] == "checkpoint shapes"
    # --tf-semantics gives any checkpoint (e.g. HuggingFace's transfo-xl-wt103) TF's window and epsilon
    first = tmp_path / "first"
    assert cli("convert", root, "-o", first, "--config", root / "flags.json").exit_code == 0
    cfg = json.loads((first / "config.json").read_text())
    cfg["config"].update(same_length_extra=0, layer_norm_epsilon=1e-5)
    (first / "config.json").write_text(json.dumps(cfg))
    second = tmp_path / "second"
    result = cli("convert", first, "-o", second, "--tf-semantics")
    assert result.exit_code == 0, result.output
    cfg2 = json.loads((second / "config.json").read_text())["config"]
    assert cfg2["same_length_extra"] == 1 and cfg2["layer_norm_epsilon"] == 1e-12
    # ...and the model computes TensorFlow's equations again, which the PyTorch-semantics copy does not
    _, weights, spec = published["full-softmax"]
    tokens = stream_for(spec, n_segments=3)
    reference = tf_reference_log_probs(weights, spec, tokens)
    T = spec["tgt_len"]
    got = {}
    for name, path in (("pytorch", first), ("tensorflow", second)):
        with TxlRuntime.load(path, backend="torch", threads=1) as rt:
            rt.start_from_zero_memory(1)  # TensorFlow's first memory, as tf_reference_log_probs starts from
            got[name] = np.concatenate([rt.step(tokens[None, s:s + T])[0] for s in range(0, len(tokens), T)])
    np.testing.assert_allclose(got["tensorflow"], reference, atol=1e-5, rtol=0)
    assert np.abs(got["pytorch"] - reference).max() > 1e-3


def test_zero_first_memory_reproduces_tensorflow_on_every_backend(published, tmp_path):
    """`start_from_zero_memory` / `eval --zero-memory`: TensorFlow's evaluation from the first segment on, on the
    eager reference, the cached PyTorch path and ONNX Runtime (incremental state, the runtimes' ring buffer)."""
    from txl_deploy.exporters.onnx.export import export_onnx

    root, weights, spec = published["adaptive-shared"]
    out = tmp_path / "converted"
    assert cli("convert", root, "-o", out, "--config", root / "flags.json").exit_code == 0
    onnx_path = tmp_path / "model.onnx"
    export_onnx(out, onnx_path, max_segment=8)
    tokens = stream_for(spec, n_segments=5, seed=2)
    reference = tf_reference_log_probs(weights, spec, tokens)
    T = spec["tgt_len"]
    for path, backend in ((out, "torch"), (out, "torch-fast"), (onnx_path, "onnxruntime")):
        with TxlRuntime.load(path, backend=backend) as rt:
            rt.start_from_zero_memory(1)
            got = np.concatenate([rt.step(tokens[None, s:s + T])[0] for s in range(0, len(tokens), T)])
            np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0, err_msg=backend)
            rt.reset()  # the default again: the paper's empty memory, which differs on the first segment
            first = rt.step(tokens[None, :T])[0]
            assert np.abs(first - reference[:T]).max() > 1e-3, backend

    # the streaming evaluation from text: the summed NLL of TensorFlow's equations
    symbols = symbols_for(spec)
    ids = np.append(tokens, symbols.index("<eos>"))  # a word corpus's line ends in <eos>, as the original read it
    text = tmp_path / "test.txt"
    text.write_text(" ".join(symbols[i] for i in tokens), encoding="utf-8")
    expected_nll = -sum(reference[t, ids[t + 1]] for t in range(len(tokens)))
    for path in (out, onnx_path):
        result = cli("eval", path, "--text", text, "--zero-memory", "--json", tmp_path / "eval.json")
        assert result.exit_code == 0, result.output
        got = json.loads((tmp_path / "eval.json").read_text())
        assert got["first_memory"] == "zeros" and got["n_tokens"] == len(tokens)
        assert got["nll"] == pytest.approx(expected_nll, rel=1e-6, abs=1e-4)


def test_huggingface_folder_keeps_hf_semantics_unless_tf_semantics(tmp_path):
    """HF's transfo-xl-wt103 came from the TF checkpoint but HF computes with the PyTorch window and eps 1e-5:
    an HF folder converts with HF's semantics by default, and with TensorFlow's under --tf-semantics."""
    import warnings

    # the only test here that builds a HuggingFace model; transformers is in the test extra (a missing one fails)
    from transformers.models.deprecated import transfo_xl as transfo
    cfg = transfo.TransfoXLConfig(vocab_size=30, cutoffs=[10, 20], d_model=16, d_embed=16, n_head=2, d_head=8,
                                  d_inner=24, div_val=2, n_layer=2, mem_len=5, clamp_len=6, same_length=True,
                                  untie_r=True, proj_share_all_but_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transfo.TransfoXLLMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "vocab.txt").write_text("".join(f"w{i}\n" for i in range(30)))
    assert cli("convert", tmp_path / "hf", "-o", tmp_path / "as-hf").exit_code == 0
    as_hf = json.loads((tmp_path / "as-hf" / "config.json").read_text())["config"]
    assert as_hf["same_length_extra"] == 0 and as_hf["layer_norm_epsilon"] == 1e-5
    result = cli("convert", tmp_path / "hf", "-o", tmp_path / "as-tf", "--tf-semantics")
    assert result.exit_code == 0, result.output
    as_tf = json.loads((tmp_path / "as-tf" / "config.json").read_text())
    assert as_tf["config"]["same_length_extra"] == 1 and as_tf["config"]["layer_norm_epsilon"] == 1e-12
    assert any("--tf-semantics" in note for note in as_tf["source"]["notes"])
    assert {k: v for k, v in as_tf["config"].items() if k not in ("same_length_extra", "layer_norm_epsilon")} == \
        {k: v for k, v in as_hf.items() if k not in ("same_length_extra", "layer_norm_epsilon")}
