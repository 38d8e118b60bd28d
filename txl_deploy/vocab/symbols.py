"""A vocabulary's symbols held compactly: one UTF-8 buffer with offsets, and a hash-sorted index to find ids.

A Python list of 267,735 strings plus the dict that finds their ids costs about 40 MB (object headers, the
dict's table, an int object per id), 7% of the WikiText-103 base model's weights and more than a runtime's other
overheads together; these arrays hold the same in about 8 MB. `SymbolTable` reads as the list did (a sequence of
str), `SymbolIndex` as the dict did (a read-only mapping of symbol to id).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Mapping, Sequence

import numpy as np

_CODEC = ("utf-8", "surrogatepass")  # a JSON vocabulary may hold lone surrogates ("\ud800"); keep them as they are


class SymbolTable(Sequence):
    """The symbols in id order. Indexing gives a str, a slice a list; equal to any sequence of the same strings."""

    def __init__(self, symbols):
        encoded = [str(s).encode(*_CODEC) for s in symbols]
        self._blob = b"".join(encoded)
        # array, not numpy: indexing it gives Python ints, several times faster to slice with
        self._ends = _ints(np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))))

    def __len__(self):
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._ends)
        i = i.__index__()
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("symbol index out of range")
        return self._blob[self._ends[i - 1] if i else 0:self._ends[i]].decode(*_CODEC)

    def __iter__(self):
        start = 0
        for end in self._ends:
            yield self._blob[start:end].decode(*_CODEC)
            start = end

    def __eq__(self, other):
        if isinstance(other, SymbolTable):
            return self._blob == other._blob and self._ends == other._ends
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        shown = ", ".join(repr(s) for s in self[:5])
        return f"SymbolTable([{shown}{', ...' if len(self) > 5 else ''}], {len(self)} symbols)"

    @property
    def nbytes(self) -> int:
        return len(self._blob) + self._ends.itemsize * len(self._ends)


class SymbolIndex(Mapping):
    """Symbol -> id for a `SymbolTable`: the symbols' hashes sorted, with their ids, searched by bisection (the
    table confirms a match, so two symbols of equal hash are told apart). Hashes are this process's `hash(str)`,
    never stored. Raises ValueError naming a symbol that occurs twice."""

    def __init__(self, table: SymbolTable, strings=None):
        """strings: the table's symbols as a list of str, if at hand (saves decoding them to hash them)."""
        self._table = table
        strings = table if strings is None else strings
        hashes = np.fromiter(map(hash, strings), dtype=np.int64, count=len(table))
        order = np.argsort(hashes, kind="stable")
        hashes = hashes[order]
        # Equal hashes: a duplicate symbol or, rarely, two symbols that collide. Each run of them is checked.
        # The duplicate named is the one that repeats first in the table, whatever this process's hashes are.
        repeats = []
        for h in np.unique(hashes[1:][hashes[1:] == hashes[:-1]]):
            seen = set()
            for i in sorted(int(i) for i in order[hashes == h]):
                if table[i] in seen:
                    repeats.append((i, table[i]))
                    break
                seen.add(table[i])
        if repeats:
            raise ValueError(f"vocabulary has a duplicate symbol {min(repeats)[1]!r}")
        self._hashes, self._ids = _ints(hashes), _ints(order)

    def __reduce__(self):
        return SymbolIndex, (self._table,)  # rebuilt where it is unpickled: another process hashes str otherwise

    def get(self, symbol, default=None):
        if not isinstance(symbol, str):
            return default
        h = hash(symbol)
        hashes = self._hashes
        k = bisect.bisect_left(hashes, h)
        while k < len(hashes) and hashes[k] == h:
            i = self._ids[k]
            if self._table[i] == symbol:
                return i
            k += 1
        return default

    def __getitem__(self, symbol):
        i = self.get(symbol)
        if i is None:
            raise KeyError(symbol)
        return i

    def __contains__(self, symbol):
        return self.get(symbol) is not None

    def __len__(self):
        return len(self._table)

    def __iter__(self):
        return iter(self._table)

    @property
    def nbytes(self) -> int:
        return self._hashes.itemsize * len(self._hashes) + self._ids.itemsize * len(self._ids)


def _ints(values: np.ndarray) -> array:
    """`values` as an array of the narrowest of int32 and int64 that holds them."""
    narrow = values.size == 0 or -2 ** 31 <= int(values.min()) and int(values.max()) < 2 ** 31
    code, dtype = ("i", np.int32) if narrow else ("q", np.int64)
    out = array(code)
    out.frombytes(np.ascontiguousarray(values, dtype=dtype).tobytes())
    return out
