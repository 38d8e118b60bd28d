"""Music models' event vocabularies, read without running them, as an `events` vocabulary.

- `dictionary.pkl`: REMI's and Compound Word's remi-xl, a pickled tuple `(event2word, word2event)` (a dict event
  -> id and a dict id -> event);
- `vocab_song_artist.pkl` and `rev_vocab_song_artist.pkl`: ProgGP's, the same two dicts pickled one a file (any
  `NAME.pkl` with its inverse beside it as `rev_NAME.pkl`).

Their pickles hold plain containers only, so their own allow-list (`EVENT_PICKLES`) lets the restricted unpickler
rebuild nothing else. The two dicts must agree: ids 0..n-1, each the other's inverse; every id is checked before the
symbol list is built, so a claimed id of 10**12 allocates nothing. The events are kept verbatim (`Note On_60`), and
the music representation they are written in (`music.representation.detect`) is stored with the vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from txl_deploy.checkpoints.unpickler import PLAIN, AllowList, RestrictedUnpickler, one_line, reading_pickle
from txl_deploy.errors import CheckpointError
from txl_deploy.music.representation import detect
from txl_deploy.vocab import Vocab

EVENT_DICTIONARY = "dictionary.pkl"
# ProgGP's event -> id file; its id -> event twin is the same name with this prefix
PAIR_FILE, REVERSE_PREFIX = "vocab_song_artist.pkl", "rev_"
SHOWN = 60  # characters of a symbol in an error

# What an event dictionary pickle may name: plain containers, nothing else.
EVENT_PICKLES = AllowList(lambda: PLAIN)


class EventUnpickler(RestrictedUnpickler):
    allow = EVENT_PICKLES


def unpickle_events(path: Path):
    """The object an event dictionary pickle holds (a Python 2 str is read as UTF-8 text)."""
    with reading_pickle(path, "an event dictionary holds only events and ids in plain dicts",
                        "event dictionary pickle"), open(path, "rb") as f:
        return EventUnpickler(f, encoding="utf-8").load()


def is_event_pair(obj) -> bool:
    """Whether `obj` is shaped as a `dictionary.pkl`: a tuple (or list) of two dicts."""
    return isinstance(obj, (tuple, list)) and len(obj) == 2 and all(isinstance(d, dict) for d in obj)


def twin_name(path: Path) -> str:
    """The name of the other file of a ProgGP-style pair (`NAME.pkl` <-> `rev_NAME.pkl`)."""
    name = path.name
    return name[len(REVERSE_PREFIX):] if name.startswith(REVERSE_PREFIX) else REVERSE_PREFIX + name


def reverse_file(path: Path) -> Path | None:
    """The other file of a ProgGP-style pair, if it is there."""
    return path.with_name(twin_name(path)) if path.with_name(twin_name(path)).is_file() else None


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    """A value of the file in an error: text quoted and cut short, a number unless it is huge, else its type."""
    if isinstance(value, str):
        return repr(value[:SHOWN])
    if _is_id(value):
        return str(value) if abs(value) < 10**12 else "a huge number"
    return f"a {type(value).__name__}"


def events_of_pair(event2word, word2event, path) -> list[str]:
    """The events in id order, once the two dicts are checked to be event -> id and id -> event over ids 0..n-1,
    each the other's inverse."""
    if not isinstance(event2word, dict) or not isinstance(word2event, dict):
        raise CheckpointError(path, "an event dictionary is two dicts, event -> id and id -> event")
    bad = next(((e, i) for e, i in event2word.items() if not (isinstance(e, str) and _is_id(i))), None)
    if bad is not None:
        raise CheckpointError(path, f"event2word maps {_shown(bad[0])} to {_shown(bad[1])}: not an "
                                    "event (text) to an id (a whole number)")
    bad = next(((i, e) for i, e in word2event.items() if not (_is_id(i) and isinstance(e, str))), None)
    if bad is not None:
        raise CheckpointError(path, f"word2event maps {_shown(bad[0])} to {_shown(bad[1])}: not an "
                                    "id (a whole number) to an event (text)")
    n = len(event2word)
    if n == 0:
        raise CheckpointError(path, "the event dictionary is empty")
    if len(word2event) != n:
        raise CheckpointError(path, f"event2word holds {n} events but word2event {len(word2event)}: they must be "
                                    "each other's inverse")
    # the ids are checked before anything is built from them: n distinct keys in [0, n) are exactly 0..n-1
    for name, ids in (("event2word", event2word.values()), ("word2event", word2event.keys())):
        outside = next((i for i in ids if not 0 <= i < n), None)
        if outside is not None:
            raise CheckpointError(path, f"{name} has id {_shown(outside)}, but the ids of {n} events are 0..{n - 1}")
    for event, i in event2word.items():
        if word2event.get(i) != event:
            other = word2event.get(i)
            says = "lacks it" if other is None else f"says {_shown(other)}"
            raise CheckpointError(path, f"event2word and word2event disagree: {_shown(event)} is {i} in event2word, "
                                        f"but word2event {says}")
    return [word2event[i] for i in range(n)]


def events_vocab(symbols: list[str], path) -> Vocab:
    """An `events` vocabulary of `symbols`, naming the representation they are written in (None if none)."""
    found = detect(symbols)
    try:
        return Vocab(symbols, kind="events", representation=found.name if found is not None else None)
    except ValueError as e:
        raise CheckpointError(path, f"vocabulary: {one_line(e, 200)}") from None


def read_event_dictionary(path: Path) -> tuple[Vocab, str]:
    """A `dictionary.pkl` (REMI, remi-xl) or either file of a ProgGP pair: the vocabulary, and what the file is."""
    obj = unpickle_events(path)
    if is_event_pair(obj):
        return events_vocab(events_of_pair(obj[0], obj[1], path), path), \
            f"{path.name} (an event dictionary: (event2word, word2event), read without running it)"
    return read_event_pair(path, obj)


def read_event_pair(path: Path, obj) -> tuple[Vocab, str]:
    """ProgGP's two files: `path` holds one dict (`obj`), its twin (`reverse_file`) the other."""
    other = reverse_file(path)
    if not isinstance(obj, dict):
        raise CheckpointError(path, "is not an event dictionary: expected a pickled (event2word, word2event) pair, "
                                    "or one dict with its inverse beside it (NAME.pkl and rev_NAME.pkl)")
    if other is None:
        raise CheckpointError(path, f"holds one dict of an event dictionary pair, but its twin {twin_name(path)} is "
                                    "not beside it (ProgGP writes NAME.pkl and rev_NAME.pkl)")
    second = unpickle_events(other)
    forward, backward = (obj, second) if not path.name.startswith(REVERSE_PREFIX) else (second, obj)
    if not isinstance(backward, dict):
        raise CheckpointError(other, "is not the inverse of an event dictionary (a dict id -> event)")
    where = path if not path.name.startswith(REVERSE_PREFIX) else other
    return events_vocab(events_of_pair(forward, backward, where), where), \
        f"{where.name} + {REVERSE_PREFIX}{where.name} (an event dictionary in two files, read without running them)"
