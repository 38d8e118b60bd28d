"""Format detection: any supported checkpoint -> one `LoadedModel` (config + state_dict in our names + vocabulary).

Every family is one `Reader` (reader.py) in `READERS`: the first whose test claims the path reads it, and each
file is read once (`Source`). Then every format gets its vocabulary through the one step `vocab_files.attach_vocab`.
The formats, the config's keys and where a vocabulary is looked for: docs/checkpoints.md.
"""

from __future__ import annotations

from txl_deploy.checkpoints import cmu, huggingface, native, nvidia, remi_xl
from txl_deploy.checkpoints.native import LoadedModel
from txl_deploy.checkpoints.reader import Reader, Source, carries_own_config
from txl_deploy.checkpoints.tensorflow import convert as tensorflow
from txl_deploy.checkpoints.tensorflow import remi
from txl_deploy.checkpoints.unpickler import pickled_class
from txl_deploy.checkpoints.vocab_files import attach_vocab
from txl_deploy.errors import CheckpointError
from txl_deploy.model.weights import stored_inv_freq_note

# Asked in this order, the first claim wins: a test on the path first (a TensorFlow checkpoint is named by its
# prefix, which is no file), then on the folder's config.json (ours before HuggingFace's: both have one), then on
# what the file holds, the most specific payloads first (a remi-xl dict also holds a state_dict).
READERS: list[Reader] = [
    remi.READER,  # a TensorFlow checkpoint too, with REMI's own names and settings
    tensorflow.READER,
    native.READER,
    huggingface.READER,
    cmu.MODEL_PT,
    nvidia.READER,
    remi_xl.READER,
    cmu.STATE_DICT,
]


def reader_named(name: str) -> Reader | None:
    """The reader whose `LoadedModel.source_format` is `name`."""
    return next((r for r in READERS if r.name == name), None)


def load_any(path, config=None, vocab=None, vocab_kind: str | None = None, preset: str | None = None,
             tokenizer: str | None = None, representation: str | None = None) -> LoadedModel:
    """Load a checkpoint of any supported format. `config`: for a checkpoint that does not carry one (path, dict
    or TxlConfig), or the training flags of a TensorFlow checkpoint; `vocab`: a vocabulary file overriding any
    other; `vocab_kind`: the vocabulary's kind ("word", "char", "bytes", "text8", "events") [default: the file's,
    the corpus's or what its symbols show]; `preset`: the published model a TensorFlow checkpoint is; `tokenizer`:
    how a word vocabulary reads text ("whitespace", "wikitext", "lm1b") [default: the vocabulary file's, or what its
    symbols show]; `representation`: the music representation of an events vocabulary ("remi", "remi-xl")
    [default: the vocabulary's own, or what its events show]."""
    source = Source(path, config=config, preset=preset, vocab=vocab)
    reader = next((r for r in READERS if r.claims(source)), None)
    if reader is None:
        raise CheckpointError(source.file, "is a torch.save file but not a Transformer-XL checkpoint (it holds "
                                           f"{_describe(source.payload)})")
    if preset is not None and "preset" not in reader.takes:
        raise CheckpointError(path, "--preset is for TensorFlow checkpoints (model.ckpt-N or the published folder)")
    if config is not None and "config" not in reader.takes:
        raise carries_own_config(reader.location(source), reader.name)
    loaded = reader.read(source)
    loaded.notes[:0] = source.notes
    attach_vocab(loaded, None if "vocab" in reader.takes else vocab, kind=vocab_kind, tokenizer=tokenizer,
                 folder=reader.vocab_folder(source), representation=representation)
    note = stored_inv_freq_note(loaded.config, loaded.state_dict)
    if note:
        loaded.notes.append(note)
    return loaded


def _describe(obj) -> str:
    if pickled_class(obj):
        return f"a pickled {pickled_class(obj)}"
    if isinstance(obj, dict):
        keys = [str(k) for k in list(obj)[:6]]
        return f"a dict with keys {', '.join(keys)}{', ...' if len(obj) > 6 else ''}" if keys else "an empty dict"
    return f"a {type(obj).__name__}"
