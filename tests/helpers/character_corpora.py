"""The paper's character corpora as the original pipelines leave them, and models that write known text.

What the original files hold (facts read in the public sources; none of their code is here):

- enwik8: `prep_enwik8.py` (salesforce/awd-lstm-lm, fetched by the original `getdata.sh`) cuts the last 5,000,000
  bytes as the test split and writes each byte as `str(byte)`, a newline byte as a line break, joined by spaces.
  `data_utils.py` reads enwik8 and text8 with `add_eos=False`: each line `strip()`ped and split on whitespace, so
  the newlines vanish.
- text8: `prep_text8.py` cuts the last 5,000,000 characters and writes
  `' '.join('_' if c == ' ' else c for c in part.strip())`.
- The vocabulary (`vocabulary.Vocab.build_vocab`): the special symbols (none for enwik8 and text8), then every
  symbol by falling count (`Counter.most_common`) over train, valid and test.
- The corpus object (`data_utils.Corpus`: `dataset`, `vocab`, the encoded splits) is pickled as `data/cache.pkl`
  by the TensorFlow code and `torch.save`d as `cache.pt` by the PyTorch code (`get_lm_corpus`).

`cycle_model` builds a one-layer Transformer-XL whose greedy continuation of any symbol is a chosen successor, so a
generated stream is known in advance: attention adds nothing (o_net is zero), and the feed-forward layer maps the
embedding of symbol i (orthogonal, zero-mean vectors) onto that of its successor, which the tied output layer then
scores highest by tens of nats. The weights are written as the original PyTorch code's `model.pt` and as a TensorFlow
checkpoint (tensorflow-cpu's own Saver, the test oracle).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import pickle
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np

try:  # the shared writers of the original checkpoint layouts (moving to tests/helpers/)
    from helpers import original_checkpoints as oc
except ImportError:
    import original_checkpoints as oc


# -- the original preprocessing -----------------------------------------------------------------------------------
def enwik8_split_txt(raw: bytes) -> str:
    """What prep_enwik8.py writes for a split (train.txt, valid.txt, test.txt)."""
    return " ".join(str(c) if c != ord("\n") else "\n" for c in raw)


def text8_split_txt(raw: str) -> str:
    """What prep_text8.py writes for a split."""
    return " ".join("_" if c == " " else c for c in raw.strip())


def read_symbols(split_txt: str) -> list[str]:
    """The symbol stream data_utils.py reads from a split file (add_eos=False): each line stripped, split."""
    out = []
    for line in io.StringIO(split_txt):
        out.extend(line.strip().split())
    return out


def build_vocab(*symbol_lists) -> list[str]:
    """idx2sym as Vocab.build_vocab builds it with no special symbols: by falling count."""
    counter = collections.Counter()
    for symbols in symbol_lists:
        counter.update(symbols)
    return [s for s, _ in counter.most_common()]


# -- corpus caches ------------------------------------------------------------------------------------------------
@contextmanager
def _classes(names):
    """Code-less classes of the original qualified names, importable only while a file is written."""
    made, saved = {}, {}
    for qualname in names:
        module, cls = qualname.rsplit(".", 1)
        parts = module.split(".")
        for n in range(1, len(parts) + 1):  # the package `utils` of `utils.vocabulary` too
            name = ".".join(parts[:n])
            if name not in made:
                saved[name] = sys.modules.get(name)
                made[name] = sys.modules[name] = types.ModuleType(name)
                if n > 1:
                    setattr(made[".".join(parts[:n - 1])], parts[n - 1], made[name])
        setattr(made[module], cls, type(cls, (), {"__module__": module, "__qualname__": cls}))
    try:
        yield {q: getattr(made[q.rsplit(".", 1)[0]], q.rsplit(".", 1)[1]) for q in names}
    finally:
        for module, old in saved.items():
            if old is None:
                sys.modules.pop(module, None)
            else:
                sys.modules[module] = old


def _corpus(C, corpus_cls, vocab_cls, symbols, dataset, split):
    vocab = C[vocab_cls]()
    vocab.__dict__.update(counter=collections.Counter({s: len(symbols) - i for i, s in enumerate(symbols)}),
                          special=[], min_freq=0, max_size=None, lower_case=False, delimiter=None, vocab_file=None,
                          idx2sym=list(symbols), sym2idx=collections.OrderedDict((s, i) for i, s in enumerate(symbols)))
    corpus = C[corpus_cls]()
    corpus.__dict__.update(dataset=dataset, vocab=vocab, train=split(), valid=split(), test=split())
    return corpus


def tf_cache_pkl(symbols, dataset) -> bytes:
    """data/cache.pkl as a Python 3 run of the TensorFlow code's data_utils.py writes it (numpy splits)."""
    with _classes(["data_utils.Corpus", "vocabulary.Vocab"]) as C:
        corpus = _corpus(C, "data_utils.Corpus", "vocabulary.Vocab", symbols, dataset,
                         lambda: np.arange(len(symbols), dtype=np.int64))
        return pickle.dumps(corpus, protocol=2)


def write_torch_cache(path, symbols, dataset, legacy: bool = False):
    """cache.pt as the PyTorch code's get_lm_corpus writes it (`torch.save(corpus)`, LongTensor splits);
    `legacy`: torch's pre-1.6 serialisation."""
    import torch

    with _classes(["data_utils.Corpus", "utils.vocabulary.Vocab"]) as C:
        corpus = _corpus(C, "data_utils.Corpus", "utils.vocabulary.Vocab", symbols, dataset,
                         lambda: torch.arange(3 * len(symbols), dtype=torch.int64))
        torch.save(corpus, path, _use_new_zipfile_serialization=not legacy)


# -- a model that writes known text -------------------------------------------------------------------------------
def cycle_model(symbols, successor: dict, d_model: int = 64, n_head: int = 2, mem_len: int = 16, tgt_len: int = 8,
                seed: int = 0):
    """(weights in the original PyTorch names as float32 numpy arrays, the original constructor's kwargs).

    Greedy generation after symbol s is successor[s] (every symbol needs one)."""
    V, D = len(symbols), d_model
    assert V < D, "needs V orthogonal zero-mean vectors in d_model dimensions"
    rng = np.random.default_rng(seed)
    # orthonormal vectors orthogonal to the all-ones vector (zero mean), scaled to unit variance per entry
    ones = np.ones((D, 1)) / np.sqrt(D)
    g = rng.standard_normal((D, D - 1))
    q, _ = np.linalg.qr(g - ones @ (ones.T @ g))
    u = (q[:, :V].T * np.sqrt(D)).astype(np.float64)  # [V, D]: u_i . u_j = D if i == j else 0; each has mean 0
    index = {s: i for i, s in enumerate(symbols)}
    d_head, d_inner = D // n_head, max(V, 8)
    w = {}
    w["word_emb.emb_layers.0.weight"] = u
    w["r_w_bias"] = 0.1 * rng.standard_normal((n_head, d_head))
    w["r_r_bias"] = 0.1 * rng.standard_normal((n_head, d_head))
    p = "layers.0."
    w[p + "dec_attn.qkv_net.weight"] = 0.1 * rng.standard_normal((3 * n_head * d_head, D))
    w[p + "dec_attn.r_net.weight"] = 0.1 * rng.standard_normal((n_head * d_head, D))
    w[p + "dec_attn.o_net.weight"] = np.zeros((D, n_head * d_head))  # attention adds nothing
    for ln in ("dec_attn.layer_norm", "pos_ff.layer_norm"):
        w[p + ln + ".weight"], w[p + ln + ".bias"] = np.ones(D), np.zeros(D)
    # relu(u_k . h - D/2) is D/2 for the input symbol k only; that unit writes 4 x its successor's vector
    w1, b1 = np.zeros((d_inner, D)), np.full(d_inner, -1.0)
    w1[:V], b1[:V] = u, -D / 2
    w2 = np.zeros((D, d_inner))
    for s, i in index.items():
        w2[:, i] = 4 * u[index[successor[s]]] / (D / 2)
    w[p + "pos_ff.CoreNet.0.weight"], w[p + "pos_ff.CoreNet.0.bias"] = w1, b1
    w[p + "pos_ff.CoreNet.3.weight"], w[p + "pos_ff.CoreNet.3.bias"] = w2, np.zeros(D)
    w["crit.out_layers.0.weight"] = u  # tied to the embedding
    w["crit.out_layers.0.bias"] = np.zeros(V)
    w["pos_emb.inv_freq"] = 1 / (10000 ** (np.arange(0.0, D, 2.0) / D))
    hp = dict(n_token=V, n_layer=1, n_head=n_head, d_model=D, d_head=d_head, d_inner=d_inner, dropout=0.0,
              dropatt=0.0, tie_weight=True, d_embed=D, div_val=1, tie_projs=[False], pre_lnorm=False,
              tgt_len=tgt_len, ext_len=0, mem_len=mem_len, cutoffs=[], same_length=False, attn_type=0, clamp_len=-1)
    return {k: v.astype(np.float32) for k, v in w.items()}, hp


def cycle_successor(cycle: list, symbols) -> dict:
    """Each symbol of `cycle` is followed by the next (the last by the first); every other symbol by the first."""
    succ = {s: cycle[0] for s in symbols}
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        succ[a] = b
    return succ


def greedy_symbols(successor: dict, last: str, n: int) -> list:
    out = []
    for _ in range(n):
        last = successor[last]
        out.append(last)
    return out


def write_original_model_pt(path, weights: dict, hp: dict, legacy: bool = False):
    """The original PyTorch train.py's `torch.save(model)` of these weights."""
    import torch

    state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    oc.save_original_model_pt(path, state, hp, legacy=legacy)


def write_nvidia_checkpoint(path, weights: dict, hp: dict, symbols, dataset: str):
    """NVIDIA's train.py checkpoint dict, with `args.dataset` naming the corpus."""
    import torch

    state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    with oc.original_modules() as C:
        torch.save({"args": argparse.Namespace(dataset=dataset, n_layer=hp["n_layer"]),
                    "model_config": dict(hp, dtype=None, sample_softmax=-1),
                    "model_state": oc.nvidia_model_state(state, hp), "vocab": oc.nvidia_vocab(C, symbols),
                    "epoch": 1, "train_step": 3}, path)


def tf_variables(weights: dict, hp: dict) -> dict:
    """The same weights under the original tf/model.py names and orientation (div_val 1, no cutoffs)."""
    t, p, q = "transformer/", "transformer/layer_0/", "layers.0."
    return {
        t + "adaptive_embed/lookup_table": weights["word_emb.emb_layers.0.weight"],
        t + "adaptive_softmax/bias": weights["crit.out_layers.0.bias"],
        t + "r_w_bias": weights["r_w_bias"], t + "r_r_bias": weights["r_r_bias"],
        p + "rel_attn/qkv/kernel": weights[q + "dec_attn.qkv_net.weight"].T.copy(),
        p + "rel_attn/r/kernel": weights[q + "dec_attn.r_net.weight"].T.copy(),
        p + "rel_attn/o/kernel": weights[q + "dec_attn.o_net.weight"].T.copy(),
        p + "rel_attn/LayerNorm/gamma": weights[q + "dec_attn.layer_norm.weight"],
        p + "rel_attn/LayerNorm/beta": weights[q + "dec_attn.layer_norm.bias"],
        p + "ff/layer_1/kernel": weights[q + "pos_ff.CoreNet.0.weight"].T.copy(),
        p + "ff/layer_1/bias": weights[q + "pos_ff.CoreNet.0.bias"],
        p + "ff/layer_2/kernel": weights[q + "pos_ff.CoreNet.3.weight"].T.copy(),
        p + "ff/layer_2/bias": weights[q + "pos_ff.CoreNet.3.bias"],
        p + "ff/LayerNorm/gamma": weights[q + "pos_ff.layer_norm.weight"],
        p + "ff/LayerNorm/beta": weights[q + "pos_ff.layer_norm.bias"],
    }


def tf_flags(hp: dict) -> dict:
    """tf/train_gpu.py's flags for these shapes and evaluation settings (a tiny model fits no published preset)."""
    return dict(n_layer=hp["n_layer"], d_model=hp["d_model"], d_embed=hp["d_embed"], n_head=hp["n_head"],
                d_head=hp["d_head"], d_inner=hp["d_inner"], div_val=1, untie_r=False,
                proj_share_all_but_first=False, proj_same_dim=True, tgt_len=hp["tgt_len"], mem_len=hp["mem_len"],
                clamp_len=hp["clamp_len"], same_length=hp["same_length"])


def write_tf_published(root, weights: dict, hp: dict, symbols, dataset: str, cache: bool = True):
    """pretrained_xl/tf_<dataset>/ as tf/sota/download.sh lays it out: model/ written by TensorFlow's Saver (V2,
    global_step), data/cache.pkl and data/corpus-info.json; plus flags.json with the training flags."""
    import tensorflow as tf

    root = Path(root)
    (root / "model").mkdir(parents=True)
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        var_list = {name: tf.compat.v1.Variable(value, name=f"v{n}")
                    for n, (name, value) in enumerate(tf_variables(weights, hp).items())}
        var_list["global_step"] = tf.compat.v1.Variable(np.int64(0), name="step")
        sess.run(tf.compat.v1.variables_initializer(list(var_list.values())))
        saver = tf.compat.v1.train.Saver(var_list=var_list, write_version=tf.compat.v1.train.SaverDef.V2)
        saver.save(sess, str(root / "model" / "model.ckpt"), global_step=0)
    (root / "data").mkdir()
    if cache:
        (root / "data" / "cache.pkl").write_bytes(tf_cache_pkl(symbols, dataset))
    (root / "data" / "corpus-info.json").write_text(json.dumps(
        {"vocab_size": len(symbols), "dataset": dataset, "cutoffs": []}))
    (root / "flags.json").write_text(json.dumps(tf_flags(hp)))
    return root


# -- the fixtures' corpora ------------------------------------------------------------------------------------------
# Stand-ins for the training text: the vocabulary is built from them as the original pipeline builds it.
ENWIK8_TRAIN = ("<page>\n  <title>Zürich</title>\n  <text>naïve café — 東京 ✓ déjà vu, é€ж日 abc</text>\n</page>\n"
                .encode("utf-8"))
ENWIK8_CYCLE = "é€ж日 abc"  # distinct bytes: greedy generation spells it over and over, a character per 1-3 tokens
TEXT8_TRAIN = " the quick brown fox jumps over the lazy dog"  # text8 starts with a space, as the real one does
TEXT8_CYCLE = "quick brown"


def enwik8_model(**kwargs):
    """(idx2sym, successor, weights, hp) of a byte-level model over ENWIK8_TRAIN that writes ENWIK8_CYCLE."""
    symbols = build_vocab(read_symbols(enwik8_split_txt(ENWIK8_TRAIN)))
    successor = cycle_successor([str(b) for b in ENWIK8_CYCLE.encode("utf-8")], symbols)
    return (symbols, successor, *cycle_model(symbols, successor, **kwargs))


def text8_model(**kwargs):
    """(idx2sym, successor, weights, hp) of a text8 model that writes TEXT8_CYCLE."""
    symbols = build_vocab(read_symbols(text8_split_txt(TEXT8_TRAIN)))
    successor = cycle_successor(["_" if c == " " else c for c in TEXT8_CYCLE], symbols)
    return (symbols, successor, *cycle_model(symbols, successor, d_model=32, **kwargs))


def greedy_bytes_text(successor, prompt: str, n: int) -> str:
    """What greedy generation of n byte tokens after `prompt` decodes to (an incomplete last character: U+FFFD)."""
    last = str(prompt.encode("utf-8")[-1])
    return bytes(int(s) for s in greedy_symbols(successor, last, n)).decode("utf-8", "replace")
