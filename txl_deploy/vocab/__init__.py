"""Vocabularies: the symbol list a model was trained with and its kind, text to token ids and back.

Kinds (`kinds.py`): `word` (WikiText-103, lm1b), `char` (our demo model), `bytes` (the paper's enwik8: UTF-8 bytes
as decimal symbols, newlines dropped as its preprocessing dropped them), `text8` (a-z, `_` for the space) and
`events` (music models' events kept verbatim, one a line, naming their representation).
`Vocab.stream_decoder()` turns generated ids into text as they arrive (`stream.py`); `Vocab.encode_corpus` reads a
whole text as the original preprocessing of the model's corpus did (`encode.py`). A word vocabulary's `tokenizer`
(`TOKENIZERS`) says how its text is split and joined: on whitespace, or WikiText-103's and One Billion Word's Moses
pipelines (`moses.py`, with sacremoses). No torch, never unpickled.
"""

from txl_deploy.vocab.encode import counting
from txl_deploy.vocab.kinds import (
    DATASET_KINDS,
    DESCRIPTIONS,
    KINDS,
    TOKENIZERS,
    UnknownKindError,
    choose_kind,
    detect_kind,
    detect_tokenizer,
    kind_note,
)
from txl_deploy.vocab.stream import CONTINUING, StreamDecoder
from txl_deploy.vocab.table import Vocab

__all__ = [
    "CONTINUING",
    "DATASET_KINDS",
    "DESCRIPTIONS",
    "KINDS",
    "TOKENIZERS",
    "StreamDecoder",
    "UnknownKindError",
    "Vocab",
    "choose_kind",
    "counting",
    "detect_kind",
    "detect_tokenizer",
    "kind_note",
]
