"""Reading a saved state (`TxlRuntime.save_state`, a Triton `saved_state`, a parked server session) from outside.

A saved state is an .npz file: a zip archive of .npy members, one per state tensor, plus a few small metadata
members. It often comes from a client (a parked conversation sent back), so it is read as untrusted input, and
nothing is allocated from what it claims before that claim is checked:

1. the archive's size against the largest state it may hold (`max_rows` rows of this model's state, plus a margin);
2. its member names: this backend's state tensors, `__fingerprint__` and the known metadata; no other member is
   ever read, and one is refused once the fingerprint is compared (so a state of another model says so);
3. the small metadata members, and the fingerprint against this model's, before any tensor data is read;
4. each member's .npy header (dtype, shape) against what this model's state of that many rows must be, and its
   size in the archive's directory against that header: the memory a state takes is exactly its own tensors;
5. then the data, straight into arrays of those shapes, in chunks; a compressed member never expands past the size
   its header claims, and zip's CRC-32 is checked at its end.

Any failure is one `InputError` (a bomb, a truncated or damaged zip, a member of the wrong shape, a state of another
model), raised before the runtime's memory changes. How many rows a compressed archive may expand to: `max_rows` if
given; else as many as its own size holds (at least one row), so a small file cannot ask for a large allocation.
"""

from __future__ import annotations

import io
import os
import struct
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.errors import InputError

FINGERPRINT, BACKEND, LAST_LOG_PROBS = "__fingerprint__", "__backend__", "__last_log_probs__"
# What save_state and the servers that park conversations write beside the tensors: name -> kind of scalar.
METADATA = {FINGERPRINT: "str", BACKEND: "str", "__format__": "str", "__format_version__": "int",
            "__sequence_id__": "int"}
MAX_METADATA_CHARS = 256
MARGIN_BYTES = 64 << 10  # zip directory and headers, npy headers, metadata: a few hundred bytes per member
MAX_NPY_HEADER = 4096  # numpy writes 128 bytes (padded to 64); its own reader allows 10000
_CHUNK = 1 << 18  # read at a time: the only memory a read takes beyond the state itself
_MAX_COUNT = 1 << 62  # a ring counter that could not overflow int64 however long the stream runs
# What a damaged archive raises inside zipfile, zlib and numpy's header parser.
_DAMAGE = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, struct.error, EOFError, OSError, ValueError,
           KeyError, IndexError, OverflowError, NotImplementedError, RuntimeError, SyntaxError, TypeError,
           tokenize.TokenError)  # numpy tokenizes an .npy header to read it


@dataclass
class SavedState:
    """A checked saved state: the backend's arrays, the last log-probs [rows, n_token] (or None), the metadata."""

    arrays: dict
    last_log_probs: np.ndarray | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(next(iter(self.arrays.values())).shape[0])


def layout_bytes(layout: dict) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in layout.values())


def read_saved_state(source, backend, max_rows: int | None = None) -> SavedState:
    """Check and read a saved state for `backend` (see the module's docstring). `source`: the bytes of an .npz
    (bytes, bytearray, memoryview or a uint8 numpy array), its path, or save_state()'s dict. The fingerprint must be
    `backend.fingerprint()`. Raises InputError, naming the problem, for anything else."""
    if isinstance(source, dict):
        return _from_dict(source, backend, max_rows)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            with open(path, "rb") as f:
                return _from_archive(f, os.fstat(f.fileno()).st_size, backend, max_rows, f"{path}: ")
        except OSError as e:
            raise InputError(f"{path}: cannot read the saved state ({e.strerror or e})") from None
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8:
            raise InputError(f"a saved state's bytes are uint8, got an array of {source.dtype}")
        source = np.ascontiguousarray(source).reshape(-1)
    if isinstance(source, (bytes, bytearray, memoryview, np.ndarray)):
        view = memoryview(source).cast("B")
        return _from_archive(_BufferReader(view), view.nbytes, backend, max_rows, "")
    raise InputError(f"a saved state is save_state()'s dict, the bytes of its .npz file or its path, not "
                     f"{type(source).__name__}")


def state_members(backend, arrays: dict, last_log_probs: np.ndarray | None = None) -> dict:
    """The members of a saved state: `arrays` (this backend's state tensors of some rows), the backend's fingerprint
    and name, and the rows' next-token log-probs [rows, n_token] (copied) when there are some. What
    `TxlRuntime.save_state` returns and every writer of a saved state starts from."""
    members = dict(arrays)
    members[FINGERPRINT], members[BACKEND] = np.array(backend.fingerprint()), np.array(backend.name)
    if last_log_probs is not None:
        members[LAST_LOG_PROBS] = np.array(last_log_probs, copy=True)
    return members


def archive_bytes(members: dict) -> bytes:
    """The bytes of the .npz file holding `members`."""
    buf = io.BytesIO()
    np.savez(buf, **members)
    return buf.getvalue()


def state_bytes(backend, arrays: dict, last_log_probs: np.ndarray | None = None) -> bytes:
    """The bytes of the .npz `TxlRuntime.save_state(path)` writes, for `arrays` and their next-token log-probs:
    what a server hands out for a parked session, and `read_saved_state` (or `TxlRuntime.load_state`) reads back."""
    return archive_bytes(state_members(backend, arrays, last_log_probs))


def max_archive_bytes(backend, rows: int = 1) -> int:
    """The largest saved state of `rows` rows for this backend, in bytes: its tensors, its last log-probs and the
    margin for the archive's headers. What a server may accept as one conversation's state."""
    return rows * row_bytes(backend) + MARGIN_BYTES


def _layout(backend, rows: int) -> dict:
    return {name: (tuple(int(d) for d in shape), np.dtype(dtype))
            for name, (shape, dtype) in backend.state_layout(rows).items()}


def row_bytes(backend) -> int:
    """Bytes of one row: its state tensors and its last log-probs."""
    return layout_bytes(_layout(backend, 1)) + backend.config.n_token * 4


# -- the archive --------------------------------------------------------------------------------------------------
def _from_archive(f, size: int, backend, max_rows, where) -> SavedState:
    row = row_bytes(backend)
    if max_rows is not None:
        max_rows = int(max_rows)
        if size > max_archive_bytes(backend, max_rows):
            raise InputError(f"{where}a saved state of {size:,} bytes is larger than this model's state of "
                             f"{max_rows} row{'s' if max_rows > 1 else ''} ({max_rows * row:,} bytes)")
    # the most tensor data a compressed archive may expand to (a stored one holds its bytes itself)
    budget = max_rows * row if max_rows is not None else max(size, row)
    try:
        with zipfile.ZipFile(f) as z:
            return _read_members(z, backend, budget, max_rows, where)
    except InputError:
        raise
    except _DAMAGE as e:
        text = " ".join(str(e).split())[:160] or type(e).__name__
        raise InputError(f"{where}not a saved txl-deploy state: a truncated or damaged archive ({text})") from None


def _read_members(z: zipfile.ZipFile, backend, budget: int, max_rows, where) -> SavedState:
    members = {}
    layout1 = _layout(backend, 1)
    allowed = set(layout1) | set(METADATA) | {LAST_LOG_PROBS}
    unexpected = []
    for info in z.infolist():
        name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
        if name not in allowed:
            unexpected.append(info.filename)  # refused after the fingerprint, which says more when it differs
            continue
        if name in members:
            raise InputError(f"{where}not a saved txl-deploy state: member {info.filename!r} appears twice")
        if info.flag_bits & 0x1:
            raise InputError(f"{where}not a saved txl-deploy state: member {info.filename!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise InputError(f"{where}not a saved txl-deploy state: member {info.filename!r} uses compression "
                             f"method {info.compress_type} (only stored and deflated are read)")
        members[name] = info
    if FINGERPRINT not in members:
        raise InputError(f"{where}not a saved txl-deploy state (no fingerprint)")
    claimed = sum(info.file_size for info in members.values())
    if claimed > budget + len(members) * MAX_NPY_HEADER:  # the exact check, on the headers, follows
        raise InputError(f"{where}a saved state that expands to {claimed:,} bytes, more than {_limit(max_rows)} "
                         f"({budget:,} bytes)")

    metadata = _read_metadata(z, members, where)
    _check_fingerprint(metadata.get(FINGERPRINT), backend, where)
    if unexpected:
        raise InputError(f"{where}not a saved state of this model: unexpected member {unexpected[0][:80]!r}")
    missing = sorted(n for n in layout1 if n not in members)
    if missing:
        raise InputError(f"{where}not a saved state of this model: no {missing[0]!r} member")

    # The rows: the first state tensor's leading dimension; every header must then match this model's state.
    first = next(iter(layout1))
    with z.open(members[first]) as fp:
        shape, _, _ = _header(fp, members[first], where)
    rows = shape[0] if len(shape) >= 1 else 0
    if rows < 1:
        raise InputError(f"{where}not a saved state of this model: {first} has shape {shape}")
    if max_rows is not None and rows > max_rows:
        raise InputError(f"{where}a saved state of {rows} rows; at most {max_rows} "
                         f"{'is' if max_rows == 1 else 'are'} accepted here")
    want = _layout(backend, rows)
    want[LAST_LOG_PROBS] = ((rows, backend.config.n_token), np.dtype(np.float32))
    if layout_bytes({n: want[n] for n in want if n in members}) > budget:  # every member is exactly this
        raise InputError(f"{where}a saved state of {rows} rows ({layout_bytes(want):,} bytes), more than "
                         f"{_limit(max_rows)} ({budget:,} bytes)")
    arrays = {}
    for name in [n for n in want if n in members]:
        shape_want, dtype_want = want[name]
        with z.open(members[name]) as fp:
            shape, dtype, header = _header(fp, members[name], where)
            if shape != shape_want or dtype != dtype_want:
                raise InputError(f"{where}state tensor {name} has shape {shape} {dtype}, this model needs "
                                 f"{shape_want} {dtype_want.name}")
            arrays[name] = _data(fp, members[name], shape, dtype, header, where)
    last = arrays.pop(LAST_LOG_PROBS, None)
    _check_values(arrays, backend, where)
    return SavedState(arrays, last, metadata)


def _read_metadata(z: zipfile.ZipFile, members: dict, where) -> dict:
    metadata = {}
    for name in sorted(set(members) & set(METADATA)):
        kind = METADATA[name]
        with z.open(members[name]) as fp:
            shape, dtype, header = _header(fp, members[name], where)
            if shape != () or (kind == "str" and (dtype.kind != "U" or dtype.itemsize > 4 * MAX_METADATA_CHARS)) \
                    or (kind == "int" and (dtype.kind not in "iu" or dtype.itemsize > 8)):
                raise InputError(f"{where}not a saved txl-deploy state: {name} is {dtype} {shape}, not a "
                                 f"{'string' if kind == 'str' else 'number'}")
            metadata[name] = _data(fp, members[name], shape, dtype, header, where).item()
    return metadata


def read_state_metadata(data) -> dict:
    """The metadata of a saved state's bytes (fingerprint, format, sequence id, ...) without its tensors, which are
    never read: for a client that only routes a state. Raises InputError on anything but a readable archive."""
    view = memoryview(data).cast("B")
    try:
        with zipfile.ZipFile(_BufferReader(view)) as z:
            members = {i.filename[:-4]: i for i in z.infolist() if i.filename[:-4] in METADATA
                       and i.filename.endswith(".npy") and i.compress_type in (zipfile.ZIP_STORED,
                                                                               zipfile.ZIP_DEFLATED)}
            return _read_metadata(z, members, "")
    except InputError:
        raise
    except _DAMAGE as e:
        text = " ".join(str(e).split())[:160] or type(e).__name__
        raise InputError(f"not a saved txl-deploy state: a truncated or damaged archive ({text})") from None


def _limit(max_rows) -> str:
    if max_rows is not None:
        return f"this model's state of {max_rows} row{'s' if max_rows > 1 else ''} and its archive"
    return ("this file may expand to (one row of this model's state, or the file's own size: pass max_rows to "
            "read a compressed state of more rows)")


def _header(fp, info, where):
    """(shape, dtype, header bytes) of a .npy member, read without its data."""
    major, _ = np.lib.format.read_magic(fp)
    if major == 1:
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp, max_header_size=MAX_NPY_HEADER)
    elif major == 2:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp, max_header_size=MAX_NPY_HEADER)
    else:
        raise InputError(f"{where}not a saved txl-deploy state: {info.filename} is .npy version {major}")
    if fortran and len(shape) > 1:
        raise InputError(f"{where}not a saved txl-deploy state: {info.filename} is in Fortran order")
    if dtype.hasobject:
        raise InputError(f"{where}not a saved txl-deploy state: {info.filename} holds Python objects")
    return tuple(int(d) for d in shape), dtype, fp.tell()


def _data(fp, info, shape, dtype, header: int, where) -> np.ndarray:
    """The member's data, read into a new array; its size in the directory must be exactly header + data."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
    if info.file_size != header + nbytes:
        raise InputError(f"{where}not a saved txl-deploy state: {info.filename} holds {info.file_size - header} "
                         f"bytes of data, its header says {nbytes}")
    out = np.empty(shape, dtype)
    flat = out.reshape(-1).view(np.uint8)
    done = 0
    while done < nbytes:
        chunk = fp.read(min(_CHUNK, nbytes - done))
        if not chunk:
            raise InputError(f"{where}not a saved txl-deploy state: {info.filename} ends early")
        flat[done:done + len(chunk)] = np.frombuffer(chunk, np.uint8)
        done += len(chunk)
    fp.read(1)  # reaches the member's end, where zipfile checks its CRC-32
    return out


# -- shared checks -----------------------------------------------------------------------------------------------
def _check_fingerprint(theirs, backend, where):
    if theirs is None:
        raise InputError(f"{where}not a saved txl-deploy state (no fingerprint)")
    ours = backend.fingerprint()
    if str(theirs) != ours:
        raise InputError(f"{where}this state was saved from another model or backend (fingerprint "
                         f"{str(theirs)[:40]}, this runtime's is {ours})")


def _check_values(arrays, backend, where):
    count = arrays.get(io_spec.MEM_COUNT)
    if count is not None and count.size and (int(count.min()) < 0 or int(count.max()) > _MAX_COUNT):
        raise InputError(f"{where}state tensor {io_spec.MEM_COUNT} holds {int(count.min())}..{int(count.max())}, "
                         "not a count of tokens")
    lens = arrays.get("lens")
    if lens is not None and lens.size and (int(lens.min()) < 0 or int(lens.max()) > backend.mem_len):
        raise InputError(f"{where}state has memory lengths outside [0, mem_len]")


def _from_dict(state: dict, backend, max_rows) -> SavedState:
    if FINGERPRINT not in state:
        raise InputError("not a saved txl-deploy state (no fingerprint)")
    layout1 = _layout(backend, 1)
    metadata = {}
    for name in set(state) & set(METADATA):
        value = np.asarray(state[name])
        if value.shape != () or value.dtype.kind not in ("U" if METADATA[name] == "str" else "iu"):
            raise InputError(f"not a saved txl-deploy state: {name} is {value.dtype} {value.shape}")
        metadata[name] = value.item()
    _check_fingerprint(metadata.get(FINGERPRINT), backend, "")
    unknown = sorted(str(k) for k in state if k not in layout1 and k not in METADATA and k != LAST_LOG_PROBS)
    if unknown:
        raise InputError(f"not a saved state of this model: unexpected entry {unknown[0][:80]!r}")
    arrays = {k: v for k, v in state.items() if k in layout1}
    missing = sorted(set(layout1) - set(arrays))
    if missing:
        raise InputError(f"this state does not belong to this model (no {missing[0]!r})")
    first = np.asarray(arrays[next(iter(layout1))])
    rows = first.shape[0] if first.ndim else 0
    if max_rows is not None and rows > int(max_rows):
        raise InputError(f"a saved state of {rows} rows; at most {max_rows} accepted here")
    last = state.get(LAST_LOG_PROBS)
    if last is not None:
        last = np.asarray(last)
        if last.shape != (rows, backend.config.n_token) or last.dtype.kind != "f":
            raise InputError(f"{LAST_LOG_PROBS} has shape {last.shape} {last.dtype}, this model needs "
                             f"{(rows, backend.config.n_token)} float32")
        last = np.array(last, dtype=np.float32)
    arrays = {k: arrays[k] for k in layout1}
    # shapes and dtypes are the backend's own check (check_state), which copies the caller's arrays
    _check_values({k: np.asarray(v) for k, v in arrays.items()}, backend, "")
    return SavedState(arrays, last, metadata)


class _BufferReader(io.RawIOBase):
    """A read-only, seekable file over a buffer, without copying it (io.BytesIO copies anything but bytes)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, b):
        n = max(0, min(len(b), self.view.nbytes - self.pos))
        b[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def read(self, n=-1):
        end = self.view.nbytes if n is None or n < 0 else min(self.view.nbytes, self.pos + n)
        data = self.view[self.pos:end].tobytes() if end > self.pos else b""
        self.pos = max(self.pos, end)
        return data

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.view.nbytes}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self.pos = base + offset
        return self.pos

    def tell(self):
        return self.pos
