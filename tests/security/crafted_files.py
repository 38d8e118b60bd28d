"""Writers of crafted files for the security tests: zip archives that may lie about their members, .npy members
with any header, and a TensorFlow bundle index (a LevelDB-style table) with valid checksums around any entries.

Written from the published formats (PKWARE's APPNOTE for zip, numpy's NEP 1 for .npy, the LevelDB table format
as txl_deploy/checkpoints/tensorflow/bundle.py describes it); they write what a malicious file would hold, which is
why the standard writers (zipfile, np.save) are not used for the lying parts.
"""

from __future__ import annotations

import ast
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from txl_deploy.checkpoints.tensorflow.bundle import TABLE_MAGIC, crc32c


# -- zip --------------------------------------------------------------------------------------------------------
@dataclass
class Member:
    name: str
    data: bytes  # the uncompressed bytes
    method: int = 8  # 0 stored, 8 deflated (anything else is written as claimed)
    declared_size: int | None = None  # what the headers claim the uncompressed size is (default: the truth)
    crc: int | None = None  # default: the true CRC-32
    flags: int = 0
    compressed: bytes | None = None  # the member's bytes as stored (default: computed from data and method)


def deflate(data: bytes, level: int = 9) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def deflated_zeros(n: int, chunk: int = 1 << 20) -> bytes:
    """A raw deflate stream of n zero bytes (n a multiple of `chunk`), built in milliseconds however large: one
    chunk compressed and fully flushed (which resets the compressor, so every identical chunk gives the same
    bytes), repeated, then the final empty block."""
    if n % chunk:
        raise ValueError("n must be a multiple of chunk")
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = c.compress(bytes(chunk)) + c.flush(zlib.Z_FULL_FLUSH)
    return piece * (n // chunk) + c.flush()


def zip_bytes(members: list[Member]) -> bytes:
    """A zip archive of `members`, written field by field (ZIP64 extra fields when a size needs them)."""
    out, central = bytearray(), bytearray()
    for m in members:
        stored = m.compressed if m.compressed is not None else (deflate(m.data) if m.method == 8 else m.data)
        size = len(m.data) if m.declared_size is None else m.declared_size
        crc = zlib.crc32(m.data) if m.crc is None else m.crc
        name = m.name.encode()
        zip64 = size >= 0xFFFFFFFF or len(stored) >= 0xFFFFFFFF or len(out) >= 0xFFFFFFFF
        extra = struct.pack("<HHQQ", 1, 16, size, len(stored)) if zip64 else b""
        s32 = 0xFFFFFFFF if zip64 else size
        c32 = 0xFFFFFFFF if zip64 else len(stored)
        offset = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, m.flags, m.method, 0, 0x21, crc, c32,
                           s32, len(name), len(extra)) + name + extra + stored
        cextra = struct.pack("<HHQQQ", 1, 24, size, len(stored), offset) if zip64 else b""
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if zip64 else 20, m.flags, m.method, 0,
                               0x21, crc, c32, s32, len(name), len(cextra), 0, 0, 0, 0,
                               0xFFFFFFFF if zip64 else offset) + name + cextra
    cd_offset = len(out)
    out += central
    if cd_offset >= 0xFFFFFFFF:
        raise ValueError("central directory offsets past 4 GiB are not written here")
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), cd_offset, 0)
    return bytes(out)


# -- npy --------------------------------------------------------------------------------------------------------
def npy_header(shape, descr: str = "<f4", fortran: bool = False, version: int = 1, text: str | None = None) -> bytes:
    """The .npy header of an array of `shape` and `descr` (or exactly `text` as the header dict)."""
    if text is None:
        text = repr({"descr": descr, "fortran_order": fortran, "shape": tuple(shape)})
    head = text.encode("latin1")
    prefix = 10 if version == 1 else 12
    pad = (64 - (prefix + len(head) + 1) % 64) % 64
    head = head + b" " * pad + b"\n"
    size = struct.pack("<H", len(head)) if version == 1 else struct.pack("<I", len(head))
    return b"\x93NUMPY" + bytes([version, 0]) + size + head


def npy_bytes(array: np.ndarray) -> bytes:
    array = np.asarray(array)
    array = array if array.flags.c_contiguous else array.copy()  # (ascontiguousarray makes a scalar 1-d)
    return npy_header(array.shape, array.dtype.str) + array.tobytes()


def parse_npy(data: bytes):
    """(header dict, data bytes) of an .npy member written by npy_bytes or np.save."""
    hlen = struct.unpack_from("<H", data, 8)[0] if data[6] == 1 else struct.unpack_from("<I", data, 8)[0]
    start = 10 if data[6] == 1 else 12
    return ast.literal_eval(data[start:start + hlen].decode("latin1")), data[start + hlen:]


def state_zip(arrays: dict, method: int = 0, **overrides) -> bytes:
    """A saved state as save_state writes it (one .npy member per entry), members replaced by `overrides`."""
    members = [Member(f"{k}.npy", npy_bytes(np.asarray(v)), method) for k, v in arrays.items()]
    for name, member in overrides.items():
        members = [m for m in members if m.name != f"{name}.npy"]
        if member is not None:
            members.append(member)
    return zip_bytes(members)


# -- TensorFlow bundle index -----------------------------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, value) -> bytes:
    """A protobuf field: an int is a varint (wire type 0), bytes are length-delimited (wire type 2)."""
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def mask_crc(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def bundle_entry(dtype: int, shape, shard_id: int, offset: int, size: int, crc: int | None) -> bytes:
    """A BundleEntryProto: dtype (1), shape (2: repeated dim (2) of size (1)), shard_id (3), offset (4), size (5),
    crc32c (6, fixed32)."""
    dims = b"".join(field(2, field(1, int(d) & 0xFFFFFFFFFFFFFFFF)) for d in shape)
    out = field(1, dtype) + field(2, dims) + (field(3, shard_id) if shard_id else b"")
    out += field(4, offset) + field(5, size)
    if crc is not None:
        out += varint(6 << 3 | 5) + struct.pack("<I", crc)
    return out


def table_block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A data block: entries with no shared key prefix (every entry a restart point), then the restart array."""
    body, restarts = bytearray(), []
    for key, value in entries:
        restarts.append(len(body))
        body += varint(0) + varint(len(key)) + varint(len(value)) + key + value
    for r in restarts:
        body += struct.pack("<I", r)
    return bytes(body + struct.pack("<I", len(restarts)))


def table_bytes(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A LevelDB-style table of sorted (key, value) entries in one data block, with valid block checksums."""
    out = bytearray()

    def block(data: bytes) -> bytes:
        nonlocal out
        handle = varint(len(out)) + varint(len(data))
        out += data + b"\0" + struct.pack("<I", mask_crc(crc32c(data + b"\0")))
        return handle

    data_handle = block(table_block(entries))
    meta_handle = block(table_block([]))
    last_key = entries[-1][0] if entries else b""
    index_handle = block(table_block([(last_key + b"\xff", data_handle)]))
    footer = meta_handle + index_handle
    footer += b"\0" * (40 - len(footer)) + struct.pack("<Q", TABLE_MAGIC)
    return bytes(out + footer)


def write_bundle(prefix, tensors: dict[str, np.ndarray], num_shards: int = 1) -> dict:
    """A TensorFlow V2 checkpoint of float32/int tensors in one shard, written without TensorFlow; returns the
    index entries {name: (dtype, shape, shard, offset, size, masked crc)} for tests to rewrite."""
    dtypes = {np.dtype("<f4"): 1, np.dtype("<i4"): 3, np.dtype("<i8"): 9}
    shard, entries = bytearray(), {}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.tobytes()
        entries[name] = (dtypes[a.dtype], a.shape, 0, len(shard), len(raw), mask_crc(crc32c(raw)))
        shard += raw
    with open(f"{prefix}.data-00000-of-{num_shards:05d}", "wb") as f:
        f.write(shard)
    write_index(prefix, entries, num_shards)
    return entries


def write_index(prefix, entries: dict, num_shards: int = 1, header: bytes | None = None) -> None:
    rows = [(b"", field(1, num_shards) if header is None else header)]
    rows += [(name.encode(), bundle_entry(*entry)) for name, entry in sorted(entries.items())]
    with open(f"{prefix}.index", "wb") as f:
        f.write(table_bytes(rows))
