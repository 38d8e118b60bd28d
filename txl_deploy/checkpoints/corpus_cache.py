"""Vocabulary files of the original pipelines, and the PyTorch code's corpus cache.

The original PyTorch code (kimiyoung/transformer-xl, `pytorch/data_utils.py:get_lm_corpus`) keeps its corpus as
`cache.pt`: `torch.save` of a `data_utils.Corpus` whose `vocab` (`utils.vocabulary.Vocab`) holds `idx2sym`, and
whose `dataset` names the corpus (`enwik8`, `text8`, `wt103`, ...); its encoded splits are tensors. Only the
pickled object tree is read here, through a restricted unpickler: the vocabulary and plain containers are
rebuilt, the tensors never are (their storages are not even read), and any other global refuses the file before
anything in it runs. No torch is needed.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

from txl_deploy.checkpoints import safe_pickle
from txl_deploy.checkpoints.safe_pickle import RefusedGlobal, pickled_class
from txl_deploy.checkpoints.tensorflow.corpus import corpus_vocab, read_cache_vocab
from txl_deploy.errors import CheckpointError
from txl_deploy.vocab import Vocab

# torch's legacy (pre-1.6) serialization starts with this number, pickled (torch/serialization.py).
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
CORPUS_CLASSES = {("data_utils", "Corpus"), ("__main__", "Corpus"), ("utils.vocabulary", "Vocab"),
                  ("vocabulary", "Vocab"), ("data_utils", "Vocab")}
PLAIN = {("collections", "OrderedDict"), ("collections", "Counter"), ("_codecs", "encode")}
_TENSOR_REBUILDS = {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter"}


def _skipped(*args, **kwargs):
    return None  # a tensor of the encoded splits: never rebuilt


class _CorpusUnpickler(safe_pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in CORPUS_CLASSES:
            return safe_pickle.inert_class(module, name)
        if module == "torch._utils" and name in _TENSOR_REBUILDS:
            return _skipped
        if module == "torch" and name.endswith("Storage") or (module, name) == ("torch.storage", "UntypedStorage"):
            return _skipped  # named in a storage's persistent id; the storage itself is never read
        if (module, name) in PLAIN or module in ("__builtin__", "builtins", "copy_reg", "copyreg"):
            return super().find_class(module, name)
        raise RefusedGlobal(module, name)

    def persistent_load(self, pid):
        return None


def _load_main_pickle(path: Path):
    """The saved object, from `*/data.pkl` of a zip archive or, in the legacy format, from the pickle after its
    headers (magic number, protocol version, system info); the tensor data that follows is never read."""
    with open(path, "rb") as f:
        if f.read(4) == b"PK\x03\x04":
            with zipfile.ZipFile(f) as z:
                names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                if not names:
                    raise CheckpointError(path, "is a zip file but not a torch.save archive (no data.pkl)")
                return _CorpusUnpickler(io.BytesIO(z.read(names[0]))).load()
        f.seek(0)
        headers = safe_pickle.Unpickler(f)
        if headers.load() != LEGACY_MAGIC:
            raise CheckpointError(path, "is not a torch.save file (a corpus cache.pt)")
        headers.load(), headers.load()  # protocol version, system info
        return _CorpusUnpickler(f).load()


def read_torch_corpus(path) -> tuple[list, str]:
    """(idx2sym, dataset) of the original PyTorch code's `cache.pt`."""
    path = Path(path)
    try:
        corpus = _load_main_pickle(path)
    except FileNotFoundError:
        raise CheckpointError(path, "vocabulary file not found") from None
    except RefusedGlobal as e:
        raise CheckpointError(path, f"refused to unpickle {e.module}.{e.name}: a corpus cache holds only the "
                                    "vocabulary, plain containers and tensors (nothing from the file was run)") from None
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OSError, MemoryError, zipfile.BadZipFile) as e:
        raise CheckpointError(path, f"truncated or corrupt corpus cache ({type(e).__name__}: {str(e)[:120]})") from None
    vocab = corpus if (pickled_class(corpus) or "").endswith(".Vocab") else safe_pickle.attr(corpus, "vocab")
    symbols = safe_pickle.attr(vocab, "idx2sym") if vocab is not None else None
    if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
        raise CheckpointError(path, f"is not a Transformer-XL corpus cache (no vocab.idx2sym list of strings in "
                                    f"{pickled_class(corpus) or type(corpus).__name__})")
    dataset = safe_pickle.attr(corpus, "dataset")
    return symbols, dataset if isinstance(dataset, str) else ""


def read_vocab_file(path, kind: str | None = None) -> Vocab:
    """Any vocabulary file `--vocab` takes: our vocab.json, a vocab.txt, a character list, the TensorFlow code's
    `cache.pkl` or the PyTorch code's `cache.pt` (whose corpus name fixes the kind: enwik8 bytes, text8 text8)."""
    path = Path(path)
    if path.suffix == ".pkl":
        return read_cache_vocab(path, kind=kind)[0]
    if path.suffix == ".pt":
        symbols, dataset = read_torch_corpus(path)
        return corpus_vocab(symbols, dataset, kind, path)
    return Vocab.read(path, kind=kind)
