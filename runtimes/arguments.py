"""Checks of the arguments users pass to the runtime (threads, counts, probabilities): one wording everywhere."""

from __future__ import annotations

import numpy as np

from txl_deploy.errors import InputError


def is_real(value) -> bool:
    """A real number (bool excluded: True is not a temperature)."""
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def whole(name: str, value, lo: int) -> int:
    """`value` as an int >= `lo`, or InputError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise InputError(f"{name} must be a whole number >= {lo}, got {value!r}")
    return int(value)


def check_threads(threads) -> int | None:
    """`threads` as given to `TxlRuntime.load`: None (each library's default) or a whole number >= 1."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise InputError(f"threads must be a whole number >= 1 (or None for the library's default), got {threads!r}")
    return int(threads)
