"""Every vocabulary file txl-deploy reads, and where it looks for one beside a checkpoint.

| file         | what it is                                                                   | read by          |
|--------------|------------------------------------------------------------------------------|------------------|
| `vocab.json` | ours: `{"kind", "symbols", "tokenizer", ...}`, or a JSON list of characters  | `Vocab.read`     |
| `vocab.txt`  | (any text file) the original code's one symbol a line, or a character list   | `Vocab.read`     |
| `vocab.pkl`  | HuggingFace's TransfoXLTokenizer vocabulary: a pickled dict (both layouts)   | `VocabUnpickler` |
| `vocab.bin`  | the same dict, `torch.save`d (pytorch-pretrained-bert)                       | `VocabUnpickler` |
| `cache.pt`   | the original PyTorch code's corpus cache (`torch.save` of a `Corpus`)        | `VocabUnpickler` |
| `cache.pkl`  | the original TensorFlow code's corpus cache (a pickled `Corpus`)             | `VocabUnpickler` |
| `dictionary.pkl` | music models' events (REMI, remi-xl): `(event2word, word2event)`         | `event_vocab`    |
| `vocab_song_artist.pkl` | ProgGP's events, with `rev_vocab_song_artist.pkl` beside it       | `event_vocab`    |

The pickles are read by the restricted unpickler with this use's allow-list (`VOCAB_PICKLES`): plain containers,
the classes of the pipelines that wrote the files as inert placeholders, compiled `re` patterns as their text,
tensors and numpy arrays of the encoded corpus skipped unread; only data is taken from what comes back (the symbols
in id order, the special symbols, the tokenizer's settings). The rules: docs/security.md.

`find_vocab(folder)` looks for `VOCAB_FILES` beside a checkpoint in that order; `attach_vocab` is the one step
`load_any` takes to give a loaded checkpoint its vocabulary.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

from txl_deploy.checkpoints.event_vocab import (
    EVENT_DICTIONARY,
    PAIR_FILE,
    REVERSE_PREFIX,
    is_event_pair,
    read_event_dictionary,
    reverse_file,
)
from txl_deploy.checkpoints.unpickler import (
    PLAIN,
    AllowList,
    RestrictedUnpickler,
    inert_class,
    pickled_class,
    reading_pickle,
)
from txl_deploy.errors import CheckpointError, InputError, TxlError
from txl_deploy.music.representation import detect
from txl_deploy.music.representation import representation as named_representation
from txl_deploy.vocab import DATASET_KINDS, Vocab, choose_kind, detect_tokenizer, kind_note

# The files looked for beside a checkpoint, in this order: ours, the original code's text list, HuggingFace's
# pickle and its torch.save twin, the original PyTorch code's corpus cache, music models' event dictionaries.
VOCAB_FILES = ("vocab.json", "vocab.txt", "vocab.pkl", "vocab.bin", "cache.pt", EVENT_DICTIONARY, PAIR_FILE)
EVENT_FILES = (EVENT_DICTIONARY, PAIR_FILE, REVERSE_PREFIX + PAIR_FILE)
PICKLE_SUFFIXES = (".pkl", ".bin", ".pt")
# torch's legacy (pre-1.6) serialization starts with this number, pickled (torch/serialization.py).
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# What HuggingFace's TransfoXLTokenizer keeps whole when a vocabulary names none: its special tokens (unk_token,
# eos_token and the additional "<formula>"; pytorch-pretrained-bert's default never_split is the same three).
HF_NEVER_SPLIT = ("<eos>", "<unk>", "<formula>")

# Classes of the code that wrote the files: placeholders holding their pickled state.
CORPUS_CLASSES = {("data_utils", "Corpus"), ("__main__", "Corpus"), ("vocabulary", "Vocab"),
                  ("utils.vocabulary", "Vocab"), ("data_utils", "Vocab"), ("__main__", "Vocab")}
TOKENIZER_CLASSES = {("transformers.tokenization_utils", "Trie"), ("tokenizers", "AddedToken"),
                     ("transformers.tokenization_utils_base", "AddedToken")}
TOKENIZER_MODULES = ("sacremoses",)  # MosesPunctNormalizer, MosesTokenizer, MosesDetokenizer (in submodules)
_NUMPY_DATA = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "dtype"),
               ("numpy", "ndarray")}
_TORCH_DATA = {("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
               ("torch._utils", "_rebuild_parameter"), ("torch.storage", "UntypedStorage"),
               ("torch.storage", "TypedStorage")}


def _skipped(*args, **kwargs):
    """An encoded split of the corpus (a tensor, a numpy array or its parts): never rebuilt, its data never read."""
    return inert_class("skipped", "Data")()


def _pattern_text(pattern, flags=0):
    """A compiled `re` pattern (pickled as `re._compile(pattern, flags)`): kept as its text, never compiled, so a
    pattern written to take forever costs nothing."""
    return inert_class("re", "Pattern")(pattern, flags)


def _names() -> dict:
    names = {**PLAIN, ("re", "_compile"): _pattern_text}
    names.update({name: _skipped for name in _NUMPY_DATA | _TORCH_DATA})
    return names


def _inert(module: str, name: str) -> bool:
    return ((module, name) in CORPUS_CLASSES or (module, name) in TOKENIZER_CLASSES
            or module.split(".")[0] in TOKENIZER_MODULES
            or (module == "torch" and name.endswith("Storage")))  # named in a storage's persistent id, never read


# What a vocabulary pickle may name (the module's docstring); needs no torch.
VOCAB_PICKLES = AllowList(_names, inert=_inert)


class VocabUnpickler(RestrictedUnpickler):
    """The restricted unpickler with `VOCAB_PICKLES`; a tensor's storage (torch.save files) is never read."""

    allow = VOCAB_PICKLES

    def persistent_load(self, pid):
        return None


# -- reading one file -------------------------------------------------------------------------------------------------
@dataclass
class VocabFile:
    """A vocabulary as read from a file: the vocabulary, what the file is (for people), and the corpus it names
    (the corpus caches' `dataset`; enwik8 and text8 fix the kind)."""

    vocab: Vocab
    format: str
    dataset: str | None = None


def _text(value):
    """A Python 2 str (read as bytes) as text: UTF-8, what the original code read its files as; else latin1."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value.decode("latin1")
    return value


def _get(obj, name):
    """`name` of a dict or of a placeholder's pickled state; a Python 2 pickle's keys are bytes."""
    d = obj if isinstance(obj, dict) else getattr(obj, "__dict__", {})
    return d.get(name, d.get(name.encode()))


def unpickle_vocab_file(path):
    """The object a vocabulary pickle holds: a plain pickle, a torch.save zip archive (its `data.pkl`) or torch's
    legacy format (the pickle after its three headers). Tensor data is never read. Python 2 pickles are read with
    `encoding="bytes"`: their str come back as bytes (see `_text`)."""
    path = Path(path)
    with reading_pickle(path, "a vocabulary file holds only symbols, plain containers and the settings of the code "
                              "that wrote it", "vocabulary pickle"), open(path, "rb") as f:
        if f.read(4) == b"PK\x03\x04":
            return _unpickle_archive(path, f)
        f.seek(0)
        first = VocabUnpickler(f, encoding="bytes").load()
        if isinstance(first, int) and first == LEGACY_MAGIC:
            VocabUnpickler(f, encoding="bytes").load()  # protocol version
            VocabUnpickler(f, encoding="bytes").load()  # system info
            return VocabUnpickler(f, encoding="bytes").load()
        return first


def _unpickle_archive(path: Path, f):
    with zipfile.ZipFile(f) as z:
        members = [i for i in z.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
        if not members:
            raise CheckpointError(path, "is a zip file but not a torch.save archive (no data.pkl)")
        if members[0].compress_type != zipfile.ZIP_STORED:
            # torch.save never compresses; a compressed member could expand to any size
            raise CheckpointError(path, "is a zip file whose data.pkl is compressed, which torch.save never writes")
        data = z.read(members[0])
    return VocabUnpickler(io.BytesIO(data), encoding="bytes").load()


def _symbols(value, what, path) -> list[str]:
    if not isinstance(value, list):
        raise CheckpointError(path, f"{what} is of type {type(value).__name__}, not a list of symbols")
    symbols = [_text(s) for s in value]
    bad = next((s for s in symbols if not isinstance(s, str)), None)
    if bad is not None:
        raise CheckpointError(path, f"{what} holds a value of type {type(bad).__name__}, not only symbols (text)")
    return symbols


def _tokenizer_vocab(d: dict, path: Path, container: str) -> VocabFile:
    """HuggingFace's TransfoXLTokenizer vocabulary: the symbols in id order (`idx2sym`, checked against `sym2idx`),
    `<unk>` (`unk_idx`), and the settings its tokenizer reads text with."""
    d = {_text(k): v for k, v in d.items()}
    sym2idx = d.get("sym2idx")
    if sym2idx is not None and not isinstance(sym2idx, dict):
        raise CheckpointError(path, f"sym2idx is of type {type(sym2idx).__name__}, not a mapping of symbols to ids")
    sym2idx = {_text(s): i for s, i in (sym2idx or {}).items()}
    if not all(isinstance(s, str) and isinstance(i, int) and not isinstance(i, bool) for s, i in sym2idx.items()):
        raise CheckpointError(path, "sym2idx is not a mapping of symbols (text) to ids (whole numbers)")
    if d.get("idx2sym") is not None:
        symbols = _symbols(d["idx2sym"], "idx2sym", path)
    else:  # sym2idx alone: its ids must be 0..n-1
        if sorted(sym2idx.values()) != list(range(len(sym2idx))):
            raise CheckpointError(path, "sym2idx's ids are not 0..n-1, and there is no idx2sym")
        symbols = sorted(sym2idx, key=sym2idx.get)
    if not symbols:
        raise CheckpointError(path, "vocabulary is empty (idx2sym holds no symbols)")
    if sym2idx:
        wrong = next((s for i, s in enumerate(symbols) if sym2idx.get(s) != i), None)
        if wrong is not None or len(sym2idx) != len(symbols):
            where = f"{wrong!r} is {sym2idx.get(wrong)} in sym2idx but {symbols.index(wrong)} in idx2sym" \
                if wrong is not None else f"sym2idx has {len(sym2idx)} symbols, idx2sym {len(symbols)}"
            raise CheckpointError(path, f"sym2idx disagrees with idx2sym: {where[:200]}")
    unk_idx = d.get("unk_idx")
    if unk_idx is not None:
        if not isinstance(unk_idx, int) or isinstance(unk_idx, bool) or not 0 <= unk_idx < len(symbols):
            raise CheckpointError(path, f"unk_idx {str(unk_idx)[:40]} is not an id of the vocabulary")
        unk = symbols[unk_idx]
    else:  # what the tokenizer looks up without one (transformers' _convert_token_to_id)
        unk = next((s for s in ("<unk>", "<UNK>") if s in sym2idx or s in symbols), "<unk>")
    lower_case = d.get("lower_case", False)
    if not isinstance(lower_case, bool):
        raise CheckpointError(path, f"lower_case is of type {type(lower_case).__name__}, not true or false")
    delimiter = _text(d.get("delimiter"))
    if delimiter is not None and not isinstance(delimiter, str):
        raise CheckpointError(path, f"delimiter is of type {type(delimiter).__name__}, not text")
    never_split = d.get("never_split")
    if never_split is None:
        never_split = HF_NEVER_SPLIT
    if not isinstance(never_split, (list, tuple, set, frozenset)):
        raise CheckpointError(path, f"never_split is of type {type(never_split).__name__}, not a list of symbols")
    never_split = tuple(_symbols(list(never_split), "never_split", path))
    special = d.get("special")
    if special is not None:
        _symbols(list(special) if isinstance(special, (tuple, set)) else special, "special", path)
    writer = "transformers' TransfoXLTokenizer.save_vocabulary" if any(pickled_class(v) for v in d.values()) or \
        "init_kwargs" in d else "TransfoXLTokenizer vocabulary, pytorch-pretrained-bert's plain dict"
    try:
        if delimiter == "":  # the tokenizer reads a line as its characters (transformers' _tokenize)
            vocab = Vocab(symbols, kind=choose_kind(symbols, default="char"), unk=unk)
        else:
            # One Billion Word's symbols are lm1b's; any other vocabulary of this tokenizer was read with its Moses
            # pipeline, HuggingFace's wikitext tokenizer, whether or not its symbols show the split markers
            tokenizer = "lm1b" if detect_tokenizer(symbols) == "lm1b" else "wikitext"
            vocab = Vocab(symbols, kind="word", unk=unk, tokenizer=tokenizer, lower_case=lower_case,
                          delimiter=delimiter, never_split=never_split)
    except (ValueError, TxlError) as e:
        raise CheckpointError(path, f"vocabulary: {e}") from None
    return VocabFile(vocab, f"{path.name} ({writer}, {container}, read without running it)")


def _corpus_vocab_file(corpus, path: Path, container: str) -> VocabFile:
    """The original code's corpus cache (a `Corpus` holding a `Vocab`, or a `Vocab` alone): `vocab.idx2sym` and
    the corpus's name."""
    vocab = corpus if (pickled_class(corpus) or "").endswith(".Vocab") else _get(corpus, "vocab")
    if vocab is None or pickled_class(vocab) is None:
        raise CheckpointError(path, f"is not a Transformer-XL corpus cache (no vocabulary in "
                                    f"{pickled_class(corpus) or type(corpus).__name__})")
    symbols = _get(vocab, "idx2sym")
    if not isinstance(symbols, list):
        raise CheckpointError(path, f"is not a Transformer-XL corpus cache (no vocab.idx2sym list in "
                                    f"{pickled_class(corpus) or type(corpus).__name__})")
    symbols = _symbols(symbols, "vocab.idx2sym", path)
    dataset = _text(_get(corpus, "dataset"))
    dataset = dataset if isinstance(dataset, str) and dataset else None
    code = "PyTorch" if container.startswith("torch.save") else "TensorFlow"
    return VocabFile(_kind_of_corpus(symbols, dataset, None, path), f"{path.name} (the original {code} code's "
                     f"corpus cache{', ' + dataset if dataset else ''}, {container}, read without running it)", dataset)


def _kind_of_corpus(symbols, dataset, kind, path) -> Vocab:
    """A corpus's vocabulary: its kind is `kind` (the user's), else the one its corpus fixes (enwik8: bytes, text8:
    text8), else what its symbols show, else word."""
    try:
        return Vocab(symbols, kind=choose_kind(symbols, explicit=kind, dataset=dataset))
    except ValueError as e:
        raise CheckpointError(path, f"vocabulary: {e}") from None


def _container(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        return "torch.save archive"
    return "torch.save file" if path.suffix in (".bin", ".pt") else "pickle"


def open_vocab_file(path, kind: str | None = None) -> VocabFile:
    """Read any vocabulary file (the module's table), its kind and tokenizer as the file says or its symbols show.
    `kind`: what the user says a text file is (a character list is read as one only when asked for "char")."""
    path = Path(path)
    if path.suffix not in PICKLE_SUFFIXES:
        vocab = Vocab.read(path, kind=kind, are_events=lambda lines: detect(lines) is not None)
        if path.suffix == ".json":
            return VocabFile(vocab, f"{path.name} (txl-deploy vocabulary)")
        return VocabFile(vocab, f"{path.name} (one {'event' if vocab.kind == 'events' else 'symbol'} a line)")
    if path.name in EVENT_FILES:  # read with the event dictionaries' own allow-list: plain containers only
        return VocabFile(*read_event_dictionary(path))
    obj = unpickle_vocab_file(path)
    container = _container(path)
    if isinstance(obj, dict) and ("idx2sym" in obj or "sym2idx" in obj or b"idx2sym" in obj):
        return _tokenizer_vocab(obj, path, container)
    if pickled_class(obj) in {f"{m}.{n}" for m, n in CORPUS_CLASSES}:
        return _corpus_vocab_file(obj, path, container)
    if is_event_pair(obj) or (isinstance(obj, dict) and reverse_file(path) is not None):
        return VocabFile(*read_event_dictionary(path))  # an event dictionary under another name: read as one
    raise CheckpointError(path, f"is a pickle but not a vocabulary (it holds {_describe(obj)}; expected "
                                "HuggingFace's TransfoXLTokenizer dict, the original code's corpus cache or a "
                                "music model's (event2word, word2event) dictionary)")


def _describe(obj) -> str:
    if pickled_class(obj):
        return f"a pickled {pickled_class(obj)}"
    if isinstance(obj, dict):
        keys = [str(_text(k))[:40] for k in list(obj)[:6]]
        return f"a dict with keys {', '.join(keys)}{', ...' if len(obj) > 6 else ''}" if keys else "an empty dict"
    return f"a {type(obj).__name__}"


def adjusted(found: VocabFile, kind: str | None, tokenizer: str | None, source,
             representation: str | None = None) -> Vocab:
    """The vocabulary read as the user says: `kind` (else the corpus's, else the file's), `tokenizer`, and the
    music `representation` of an events vocabulary (else the one stored with it, else the one its events show)."""
    vocab = found.vocab
    try:
        if kind is not None or (found.dataset in DATASET_KINDS and vocab.kind != DATASET_KINDS[found.dataset]):
            vocab = vocab.with_kind(choose_kind(vocab.symbols, explicit=kind, dataset=found.dataset))
        if tokenizer is not None:
            vocab = vocab.with_tokenizer(tokenizer)
    except ValueError as e:
        raise CheckpointError(source, f"vocabulary {e}") from None
    return with_representation(vocab, representation, source)


def with_representation(vocab: Vocab, name: str | None, source) -> Vocab:
    """An events vocabulary naming its music representation: `name` (the user's: its events must be that
    representation's), else the one it names, else the one its events show (`music.representation.detect`)."""
    if vocab.kind != "events":
        if name is not None:
            raise InputError(f"--representation {name}: the vocabulary is of kind {vocab.kind}; music representations "
                             "are for events vocabularies (pass --vocab-kind events)")
        return vocab
    if name is None:
        if vocab.representation is not None:
            return vocab
        found = detect(vocab.symbols)
        return vocab if found is None else vocab.with_representation(found.name)
    chosen = named_representation(name)
    foreign = next((s for s in vocab.symbols if not (s.startswith("<") and s.endswith(">"))
                    and chosen.split(s) is None), None)
    if foreign is not None:
        raise CheckpointError(source, f"vocabulary's event {foreign[:60]!r} is not one of the {chosen.name} "
                                      f"representation's ({chosen.description})")
    return vocab.with_representation(chosen.name)


def read_vocab_file(path, kind: str | None = None, tokenizer: str | None = None,
                    representation: str | None = None) -> Vocab:
    """Any vocabulary file `--vocab` takes (the module's table). `kind`: what the user says it is (word, char, bytes,
    text8) [default: the file's, the corpus's, or what its symbols show]; `tokenizer`: how a word vocabulary reads
    text (whitespace, wikitext, lm1b) [default: the file's, or what its symbols show]; `representation`: the music
    representation of an events vocabulary (remi, remi-xl) [default: the file's, or what its events show]."""
    kind = "events" if kind is None and representation is not None else kind
    return adjusted(open_vocab_file(path, kind), kind, tokenizer, path, representation)


def find_vocab(folder) -> Path | None:
    """The vocabulary file beside a checkpoint: the first of `VOCAB_FILES` in `folder`, else None."""
    folder = Path(folder)
    return next((folder / name for name in VOCAB_FILES if (folder / name).is_file()), None)


# -- the one step that gives a loaded checkpoint its vocabulary ----------------------------------------------------
def attach_vocab(loaded, vocab=None, kind: str | None = None, tokenizer: str | None = None, folder=None,
                 representation: str | None = None):
    """Give `loaded` (a LoadedModel) its vocabulary: the file `vocab` (the user's), else the one the checkpoint
    carries (ours, NVIDIA's, a TensorFlow corpus cache), else the first of `VOCAB_FILES` in `folder`; then read it
    as the user says (`kind`, `tokenizer`, an events vocabulary's music `representation`; a representation alone
    reads the vocabulary as events) and check its size against the model's. Without one, `loaded.vocab` stays
    None. Sets `vocab_source` (the file) and `vocab_format` (what the file is)."""
    kind = "events" if kind is None and representation is not None else kind
    if vocab is not None or (loaded.vocab is None and folder is not None and find_vocab(folder) is not None):
        path = Path(vocab) if vocab is not None else find_vocab(folder)
        found = open_vocab_file(path, kind)
        loaded.vocab, loaded.vocab_source, loaded.vocab_format = found.vocab, str(path), found.format
        loaded.dataset = found.dataset or loaded.dataset
    if loaded.vocab is None:
        return loaded
    if loaded.vocab_source is None:
        loaded.vocab_source = loaded.path
    carried = VocabFile(loaded.vocab, loaded.vocab_format or "", loaded.dataset)
    loaded.vocab = adjusted(carried, kind, tokenizer, loaded.vocab_source, representation)
    if len(loaded.vocab) != loaded.config.n_token:
        raise CheckpointError(loaded.vocab_source, f"vocabulary has {len(loaded.vocab)} symbols but the model has "
                                                   f"n_token={loaded.config.n_token}")
    note = kind_note(loaded.vocab)
    if note:
        loaded.notes.append(note)
    return loaded
