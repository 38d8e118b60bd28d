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
from txl_deploy.contract.onnx_file import varint


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


# -- torch.save files and pickles -----------------------------------------------------------------------------------
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _StorageRef:
    """Stands for a storage in a crafted pickle: pickled as torch's persistent id for it."""

    def __init__(self, key: str, numel: int, shape=None, stride=None, offset: int = 0):
        self.key, self.numel, self.offset = key, numel, offset
        self.shape = (numel,) if shape is None else tuple(shape)
        self.stride = tuple(stride) if stride is not None else tuple(
            int(np.prod(self.shape[i + 1:], dtype=object)) for i in range(len(self.shape)))


class _Tensor:
    def __init__(self, ref: _StorageRef):
        self.ref = ref

    def __reduce__(self):
        import collections

        import torch._utils  # optional (the torch extra): the tests that craft torch files have it

        r = self.ref
        return (torch._utils._rebuild_tensor_v2, (r, r.offset, r.shape, r.stride, False, collections.OrderedDict()))


class Reduce:
    """Pickles as `fn(*args)`: a crafted REDUCE."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _pickle_with_storages(obj, legacy: bool) -> bytes:
    import io
    import pickle

    import torch  # optional (the torch extra): the tests that craft torch files have it

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _StorageRef):
                pid = ("storage", torch.FloatStorage, o.key, "cpu", o.numel)
                return pid + (None,) if legacy else pid
            return None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(obj)
    return buf.getvalue()


def tensor(key: str, numel: int, **kwargs):
    """A tensor over storage `key` whose persistent id claims `numel` float32 elements."""
    return _Tensor(_StorageRef(key, numel, **kwargs))


def legacy_torch_file(obj, storages: dict[str, int]) -> bytes:
    """A torch.save file in the pre-1.6 format: magic, protocol, system info, the pickle, the storage keys, then
    each storage as its element count and `storages[key]` float32 zeros (what the file really holds)."""
    import pickle

    out = bytearray()
    for header in (LEGACY_MAGIC, 1001, {"protocol_version": 1001, "little_endian": True,
                                        "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        out += pickle.dumps(header, protocol=2)
    out += _pickle_with_storages(obj, legacy=True)
    out += pickle.dumps(sorted(storages), protocol=2)
    for key in sorted(storages):
        out += struct.pack("<q", storages[key]) + bytes(4 * storages[key])
    return bytes(out)


def zip_torch_file(obj, storages: dict[str, int], name: str = "archive") -> bytes:
    """A torch.save file in the zip format: data.pkl, then data/<key> holding `storages[key]` float32 zeros."""
    import zipfile

    buf = __import__("io").BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", _pickle_with_storages(obj, legacy=False))
        z.writestr(f"{name}/byteorder", "little")
        for key, numel in storages.items():
            z.writestr(f"{name}/data/{key}", bytes(4 * numel))
        z.writestr(f"{name}/version", "3\n")
    return buf.getvalue()


def safetensors_file(header: dict, data: bytes = b"") -> bytes:
    import json

    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def onnx_with_length(path_bytes: bytes, field_number: int, claimed: int) -> bytes:
    """An ONNX file whose first field of number `field_number` claims `claimed` bytes (the rest as it was)."""
    key = varint(field_number << 3 | 2)
    return key + varint(claimed) + path_bytes[:64]
