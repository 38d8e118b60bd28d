"""The one restricted unpickler: every pickle txl-deploy reads goes through `RestrictedUnpickler`, with the
allow-list of its use (`AllowList`), so nothing a file names is imported or run unless that list allows it.

Two uses: `torch_files` (the weights of legacy PyTorch checkpoints) and `vocab_files` (vocabulary pickles). A
global is resolved only if its use's list names it or spells it as one of its classes, which come back as
`InertObject`s (the pickled attributes, no behaviour); anything else raises `RefusedGlobal` the moment the pickle
names it, before any call. Every pickle's lengths are checked against the file before it is unpickled
(`pickle_lengths`). The rules and what each use allows: docs/security.md.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import functools
import pickle
import re
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from txl_deploy.checkpoints.pickle_lengths import check_lengths
from txl_deploy.errors import CheckpointError

_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*\Z")


def is_class_name(name: str) -> bool:
    """Whether `name` is spelled as a class is (CamelCase): only such names become inert placeholders."""
    return bool(_CLASS_NAME.match(name))


class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module, name):
        self.module, self.name = module, name
        super().__init__(f"refused global {module}.{name}")


class InertObject:
    """Stands in for an instance of a class from an allowed source module: the pickled attributes, no behaviour."""

    _pickled_class = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["_init_args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state, slots = state
            if isinstance(slots, dict):
                self.__dict__.update(_plain_attributes(slots))
        if isinstance(state, dict):
            self.__dict__.update(_plain_attributes(state))
        elif state is not None:
            self.__dict__["_state"] = state

    def __repr__(self):
        return f"<inert {self._pickled_class}>"


def _plain_attributes(state: dict) -> dict:
    """A pickled state as attributes, refusing a name like `__setstate__`: set on a placeholder, the unpickler would
    look it up there and call it on the next BUILD. Real objects' pickled states hold no such names."""
    for key in state:
        if isinstance(key, str) and key.startswith("__") and key.endswith("__"):
            raise pickle.UnpicklingError(f"a pickled state that sets {key[:40]} on a placeholder object")
    return state


_inert_classes: dict[str, type] = {}


def inert_class(module: str, name: str) -> type:
    qualname = f"{module}.{name}"
    if qualname not in _inert_classes:
        _inert_classes[qualname] = type(name, (InertObject,), {"_pickled_class": qualname, "__module__": __name__})
    return _inert_classes[qualname]


def pickled_class(obj) -> str | None:
    """`module.Name` of the class an inert object was pickled as, else None."""
    return obj._pickled_class if isinstance(obj, InertObject) else None


def attr(obj, name, default=None):
    """An attribute of an inert object (its pickled __dict__ entry), or `default`."""
    return getattr(obj, "__dict__", {}).get(name, default)


def data_only(kind):
    """bytes / bytearray from data (a str and its encoding, or bytes), never from a size: `bytes(2**40)` in a
    pickle would allocate a terabyte of zeros."""
    def rebuild(*args):
        if args and not isinstance(args[0], (str, bytes, bytearray)):
            raise pickle.UnpicklingError(f"{kind.__name__}() of a {type(args[0]).__name__} (only of data)")
        return kind(*args)

    return rebuild


def latin1_encode(obj, encoding="utf-8", errors="strict"):
    # protocol 2 spells bytes as _codecs.encode(str, "latin1"); no other codec is needed (or wanted)
    if not isinstance(obj, str) or str(encoding).lower().replace("-", "").replace("_", "") not in ("latin1",):
        raise pickle.UnpicklingError(f"_codecs.encode({type(obj).__name__}, {str(encoding)[:20]!r}) is not bytes")
    return codecs.encode(obj, "latin1", errors)


# The plain containers and bytes every use rebuilds: data, never code, never an allocation of a claimed size.
PLAIN = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "Counter"): collections.Counter,
    ("builtins", "dict"): dict, ("builtins", "list"): list, ("builtins", "tuple"): tuple,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
    ("builtins", "bytes"): data_only(bytes), ("builtins", "bytearray"): data_only(bytearray),
    ("_codecs", "encode"): latin1_encode,  # how protocol 2 spells bytes
}


@dataclass(frozen=True)
class AllowList:
    """What one use of the unpickler may rebuild.

    `names`: the globals it may name, `(module, name) -> object` (built on first use: torch's need torch);
    `inert(module, name)`: the classes that come back as `InertObject`s holding their pickled state. Any other
    global is refused."""

    names: Callable[[], Mapping[tuple[str, str], object]]
    inert: Callable[[str, str], bool] = lambda module, name: False

    def __post_init__(self):
        object.__setattr__(self, "names", functools.cache(self.names))

    def resolve(self, module: str, name: str):
        """The object a pickle may name as `module.name` (Python 2's names mapped to Python 3's), or
        RefusedGlobal."""
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        names = self.names()
        if (module, name) in names:
            return names[(module, name)]
        if is_class_name(name) and self.inert(module, name):
            return inert_class(module, name)
        raise RefusedGlobal(module, name)


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose `find_class` resolves only its use's `allow` list, over a pickle whose lengths were
    checked against the file first (`check_lengths`). A use subclasses it with its list, and says what its
    persistent ids (torch's storages) are."""

    allow: AllowList

    def __init__(self, file, *args, **kwargs):
        check_lengths(file)
        super().__init__(file, *args, **kwargs)

    def find_class(self, module, name):
        return self.allow.resolve(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id in a pickle that has no storages")


def one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# What unpickling a damaged or hostile pickle may raise besides RefusedGlobal: the file's bytes reach the opcodes'
# own arguments (a bad length, a wrong type for REDUCE, a huge memo index, a truncated zip around it).
UNREADABLE = (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, LookupError, OSError,
              MemoryError, RecursionError, ArithmeticError, NotImplementedError, struct.error, zipfile.BadZipFile)


@contextmanager
def reading_pickle(path: Path, holds: str, kind: str) -> Iterator[None]:
    """Turns what unpickling the file at `path` raises into a one-line CheckpointError: a refused global names
    what such a file `holds`, a damaged pickle says it is a truncated or corrupt `kind`. A CheckpointError raised
    inside passes through as it is."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(path, "vocabulary file not found") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a folder, not a vocabulary file") from None
    except RefusedGlobal as e:
        raise CheckpointError(path, f"refused to unpickle {e.module[:60]}.{e.name[:60]}: {holds} (nothing from the "
                                    "file was run)") from None
    except UNREADABLE as e:
        raise CheckpointError(path, f"truncated or corrupt {kind} ({type(e).__name__}: {one_line(e, 120)})") \
            from None
