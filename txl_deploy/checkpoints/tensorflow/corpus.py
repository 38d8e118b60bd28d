"""The vocabulary of a TensorFlow checkpoint's corpus: `data/cache.pkl` through the restricted unpickler, and
`data/corpus-info.json` (vocabulary size, cutoffs, dataset name), cross-checked against the weights."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from txl_deploy.checkpoints import safe_pickle
from txl_deploy.checkpoints.safe_pickle import RefusedGlobal, pickled_class
from txl_deploy.errors import CheckpointError
from txl_deploy.vocab import Vocab, choose_kind


def _corpus_unpickler():
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


def corpus_vocab(symbols, dataset, kind, path) -> Vocab:
    """The vocabulary of an original corpus object: its kind is `kind` (the user's), else the one its corpus
    fixes (enwik8: bytes, text8: text8), else what its symbols show, else word."""
    try:
        return Vocab(symbols, kind=choose_kind(symbols, explicit=kind, dataset=dataset or None))
    except ValueError as e:
        raise CheckpointError(path, str(e)) from None


def read_cache_vocab(path, kind: str | None = None):
    """The vocabulary of `data/cache.pkl` (a pickled `data_utils.Corpus` holding a `vocabulary.Vocab`), read with
    the restricted unpickler: only the symbol list and the plain containers around it are rebuilt, the numpy
    arrays of the encoded splits are skipped, and any other global (code) refuses the file before anything runs.

    Python 2 pickles are read with `encoding="bytes"`: their str objects come back as bytes and are decoded as
    UTF-8 (what the original code read its text files as), so a word like "café" is not turned into mojibake as a
    latin1 reading would."""
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
    dataset = _text(_attr(corpus, "dataset") or "")
    return corpus_vocab([_text(s) for s in symbols], dataset, kind, path), dataset


def read_corpus_info(path) -> dict:
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(path, f"unreadable corpus-info.json ({str(e)[:200]})") from None
    if not isinstance(info, dict):
        raise CheckpointError(path, "corpus-info.json is not a JSON object")
    return info


def check_corpus_info(info: dict, arch: dict, where) -> None:
    size = info.get("vocab_size")
    if size is not None and int(size) != arch["n_token"]:
        raise CheckpointError(where, f"vocab_size {size} but the checkpoint's embedding has {arch['n_token']} rows")
    cutoffs = [int(c) for c in info.get("cutoffs") or []]
    # corpus-info.json lists 0 and the vocabulary size around the cutoffs (train_gpu.py reads [1:-1]).
    inner = cutoffs[1:-1] if cutoffs else []
    if inner != list(arch["cutoffs"]):
        raise CheckpointError(where, f"cutoffs {cutoffs} but the checkpoint's clusters end at "
                                     f"{arch['cutoffs'] + [arch['n_token']]}")
