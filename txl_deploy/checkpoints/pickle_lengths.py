"""Every length a pickle claims, checked against the file before the pickle is unpickled (`check_lengths`).

Python's unpickler allocates what a length-prefixed opcode says before it reads the bytes (3.11: 1 TiB for a 9-byte
BINBYTES8 header), and its memo grows to the largest index it is given. Walking the opcodes first, without building
anything, bounds every allocation the unpickler then makes by the bytes the file holds.
"""

from __future__ import annotations

import io
import pickle
import pickletools

_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_MAX_LINE = 1 << 20  # read at a time while looking for the end of a text argument (protocol 0)
_CHUNK = 1 << 16
_COUNTED = {pickletools.TAKEN_FROM_ARGUMENT1: (1, True), pickletools.TAKEN_FROM_ARGUMENT4: (4, False),
            pickletools.TAKEN_FROM_ARGUMENT4U: (4, True), pickletools.TAKEN_FROM_ARGUMENT8U: (8, True)}


def _opcode_table() -> dict[int, tuple[str, str, int]]:
    """opcode byte -> (name, how its argument is laid out, bytes): "none", "fixed" n bytes, "counted" (a length of n
    bytes, then that many bytes), "lines" (n newline-terminated lines), "memo" (a memo index of n bytes), "frame"."""
    table = {}
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            layout, n = "none", 0
        elif arg.n == pickletools.UP_TO_NEWLINE:
            layout, n = "lines", 2 if arg.name == "stringnl_noescape_pair" else 1
        elif arg.n in _COUNTED:
            layout, n = "counted", arg.n
        elif op.name == "FRAME":
            layout, n = "frame", arg.n
        elif op.name in _MEMO_PUTS:
            layout, n = "memo", arg.n
        else:
            layout, n = "fixed", arg.n
        table[op.code.encode("latin1")[0]] = (op.name, layout, n)
    return table


_OPCODES = _opcode_table()


def check_lengths(file) -> None:
    """Walk the pickle that starts at `file`'s position up to its STOP opcode without building anything, and refuse
    (UnpicklingError) any length that runs past the end of the file, or a memo index ahead of the opcodes read so
    far; then seek back. Python's unpickler allocates a length before reading it; this bounds every allocation it
    makes by the bytes the file holds. A file object that cannot seek is not checked (torch and this module always
    pass seekable ones). Reads through a buffer and seeks over the data it skips: never reads what it skips."""
    try:
        if not file.seekable():
            return
        start = file.tell()
        end = file.seek(0, io.SEEK_END)
        file.seek(start)
    except (AttributeError, OSError, ValueError):
        return
    table = _OPCODES
    base, buf, pos, ops = start, b"", 0, 0  # the buffer holds the file's bytes from `base`

    def refill(need):
        nonlocal base, buf, pos
        base += pos
        file.seek(base)
        buf, pos = file.read(max(_CHUNK, need)), 0
        if len(buf) < need:
            raise pickle.UnpicklingError("pickle data was truncated")

    try:
        while True:
            if pos >= len(buf):
                refill(1)
            entry = table.get(buf[pos])
            if entry is None:
                raise pickle.UnpicklingError(f"invalid pickle opcode {buf[pos]:#04x} at byte {base + pos}")
            pos += 1
            ops += 1
            name, layout, n = entry
            if layout == "none":
                if name == "STOP":
                    return
                continue
            if layout == "lines":
                for _ in range(n):
                    found = buf.find(b"\n", pos)
                    if found < 0:  # not in the buffer: read on from here to the line's end (the file bounds it)
                        refill(0)
                        while found < 0:
                            more = file.read(_MAX_LINE)
                            if not more:
                                raise pickle.UnpicklingError("a text argument that is not a line")
                            found = (buf + more).find(b"\n", len(buf))
                            buf += more
                    line, pos = buf[pos:found], found + 1
                if name in _MEMO_PUTS:
                    _memo_index(line, ops)
                continue
            width = _COUNTED[n][0] if layout == "counted" else n
            if layout == "fixed":
                skip = width
            else:
                if pos + width > len(buf):
                    refill(width)
                signed = layout == "counted" and not _COUNTED[n][1]
                value = int.from_bytes(buf[pos:pos + width], "little", signed=signed)
                pos += width
                if layout == "memo":
                    _memo_index(str(value).encode(), ops)
                    continue
                if layout == "frame":
                    if value > end - base - pos:
                        raise pickle.UnpicklingError(f"a frame of {value:,} bytes with {end - base - pos:,} left")
                    continue  # a frame holds opcodes: they are walked one by one
                if value < 0:
                    raise pickle.UnpicklingError(f"{name} of negative length {value}")
                skip = value
            if skip > end - base - pos:
                raise pickle.UnpicklingError(f"{name} claims {skip:,} bytes with {end - base - pos:,} left in the "
                                             "file")
            if pos + skip <= len(buf):
                pos += skip
            else:  # past the buffer: seek, never read
                base, buf, pos = base + pos + skip, b"", 0
    finally:
        file.seek(start)


def _memo_index(line: bytes, ops: int) -> int:
    try:
        index = int(line.strip() or b"-1")
    except ValueError:
        raise pickle.UnpicklingError("a memo index that is not a number") from None
    # The memo grows to twice the largest index: writers number entries in order, so none is ahead of the opcodes.
    if not 0 <= index <= ops:
        raise pickle.UnpicklingError(f"memo index {index} after {ops} opcodes")
    return index
