"""Handing memory the process's heap has freed back to the system: the exporter after each phase, the ONNX Runtime
backend after a prompt's segments."""

from __future__ import annotations

import ctypes
import functools


def return_free_memory() -> None:
    """Hand memory the heap has freed back to the system (glibc's malloc_trim; elsewhere nothing to do).

    glibc keeps freed blocks below its mmap threshold (which it raises up to 32 MiB as large blocks are freed) for
    reuse, and a stream of differently sized calls fragments them: over a verification of the WikiText-103-large
    shape the resident set grew by gigabytes that nothing was using."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
