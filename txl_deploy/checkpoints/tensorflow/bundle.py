"""A reader of TensorFlow's V2 checkpoint bundle (`model.ckpt-N.index` + `model.ckpt-N.data-0000K-of-0000N`),
in numpy alone: converting the paper's checkpoints should not need a 600 MB TensorFlow install.

Written from the published descriptions of the formats (no code taken from TensorFlow or LevelDB):

- The `.index` file is a LevelDB-style sorted table. Its last 48 bytes are a footer: two block handles
  (metaindex, index; each a varint64 offset and a varint64 size), zero padding, and the 8-byte magic
  0xdb4775248b80fb57. Every block is followed by a 1-byte compression type and a masked crc32c of the block and
  that byte. A block holds prefix-compressed entries (varint32 shared key bytes, varint32 new key bytes,
  varint32 value size, the new key bytes, the value), then an array of uint32 restart offsets and their count.
  The index block maps the last key of every data block to that block's handle.
- In the data blocks, the empty key holds a `BundleHeaderProto` (num_shards, endianness) and every other key is a
  tensor name whose value is a `BundleEntryProto`: dtype, shape, shard_id, offset, size, crc32c (masked, of the
  tensor's raw bytes), and slices for partitioned variables (not used by the published models, refused).
- Shard K of N is `<prefix>.data-%05d-of-%05d`; a tensor is `size` raw little-endian bytes at `offset` in it.

Both protobuf messages are decoded here from the wire format (varints and length-delimited fields), so the reader
depends on neither TensorFlow nor protobuf.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from pathlib import Path

import numpy as np

from txl_deploy.errors import CheckpointError

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
BLOCK_TRAILER_SIZE = 5  # compression type + masked crc32c

# TensorFlow DataType enum values -> numpy dtypes (bfloat16 is widened to float32 on read).
DTYPES = {
    1: np.dtype("<f4"),  # DT_FLOAT
    2: np.dtype("<f8"),  # DT_DOUBLE
    3: np.dtype("<i4"),  # DT_INT32
    4: np.dtype("u1"),  # DT_UINT8
    5: np.dtype("<i2"),  # DT_INT16
    6: np.dtype("i1"),  # DT_INT8
    9: np.dtype("<i8"),  # DT_INT64
    10: np.dtype("?"),  # DT_BOOL
    14: np.dtype("<u2"),  # DT_BFLOAT16 (the upper half of a float32)
    17: np.dtype("<u2"),  # DT_UINT16
    19: np.dtype("<f2"),  # DT_HALF
    22: np.dtype("<u4"),  # DT_UINT32
    23: np.dtype("<u8"),  # DT_UINT64
}
DT_BFLOAT16, DT_STRING = 14, 7
MAX_RANK = 32  # TensorFlow allows 254 dimensions, numpy 64; a Transformer-XL variable has at most 3
DTYPE_NAMES = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string",
               9: "int64", 10: "bool", 14: "bfloat16", 17: "uint16", 19: "float16", 22: "uint32", 23: "uint64"}


# -- crc32c (Castagnoli), as LevelDB and TensorFlow store it ------------------------------------------------
def _crc_table() -> np.ndarray:
    poly = 0x82F63B78  # reflected Castagnoli polynomial
    table = np.zeros(256, dtype=np.uint32)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table[n] = c
    return table


_TABLE = _crc_table()
_TABLE_LIST = [int(x) for x in _TABLE]


def _crc_register(data, reg: int) -> int:
    """The raw CRC register after feeding `data` (no initial or final inversion), byte by byte."""
    t = _TABLE_LIST
    for b in bytes(data):
        reg = t[(reg ^ b) & 0xFF] ^ (reg >> 8)
    return reg


@functools.lru_cache(maxsize=None)
def _zeros_operator(n_bytes: int) -> list[list[int]]:
    """Four 256-entry tables giving the register after `n_bytes` zero bytes, as a GF(2)-linear map of the register.

    Feeding zeros is linear in the register; the map for n bytes is the one-byte map raised to the n-th power."""
    def apply(cols, reg):
        out = 0
        for bit in range(32):
            if reg >> bit & 1:
                out ^= cols[bit]
        return out

    one = [_crc_register(b"\0", 1 << bit) for bit in range(32)]  # columns of the one-byte map
    result = [1 << bit for bit in range(32)]  # identity
    power, n = one, n_bytes
    while n:
        if n & 1:
            result = [apply(power, c) for c in result]
        power = [apply(power, c) for c in power]
        n >>= 1
    return [[apply(result, b << (8 * k)) for b in range(256)] for k in range(4)]


def _slice8_tables() -> np.ndarray:
    tables = np.zeros((8, 256), dtype=np.uint32)
    tables[0] = _TABLE
    for k in range(1, 8):
        tables[k] = (tables[k - 1] >> 8) ^ _TABLE[tables[k - 1] & 0xFF]
    return tables


_T8 = _slice8_tables()


def crc32c(data) -> int:
    """crc32c of a bytes-like object. Large buffers are split into lanes that numpy advances in parallel, 8 bytes
    a step (slicing-by-8 tables); the lane registers are then chained with the zero-feeding map (the register is
    affine in its initial value: crc(a + b) = zeros_map_len(b)(reg after a) ^ reg of b alone)."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = buf.size
    if n < (1 << 16):
        return _crc_register(buf.tobytes(), 0xFFFFFFFF) ^ 0xFFFFFFFF
    # Two fixed lane lengths, so the zero-feeding map is computed once each (about 55 MB/s on one core).
    lane_len = 256 if n < (1 << 24) else 4096
    lanes = n // lane_len
    words = np.ascontiguousarray(buf[: lanes * lane_len]).view("<u8").reshape(lanes, lane_len // 8)
    regs = np.zeros(lanes, dtype=np.uint32)
    t = _T8
    for start in range(0, words.shape[1], 64):
        cols = np.ascontiguousarray(words[:, start : start + 64].T)  # [<=64, lanes]: 8 bytes of every lane a row
        for row in cols:
            x = regs ^ (row & 0xFFFFFFFF).astype(np.uint32)
            hi = (row >> 32).astype(np.uint32)
            regs = (t[7][x & 0xFF] ^ t[6][(x >> 8) & 0xFF] ^ t[5][(x >> 16) & 0xFF] ^ t[4][x >> 24]
                    ^ t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24])
    shift = _zeros_operator(lane_len)
    reg = 0xFFFFFFFF
    for r in regs.tolist():
        reg = (shift[0][reg & 0xFF] ^ shift[1][reg >> 8 & 0xFF] ^ shift[2][reg >> 16 & 0xFF]
               ^ shift[3][reg >> 24]) ^ r
    reg = _crc_register(buf[lanes * lane_len :].tobytes(), reg)
    return reg ^ 0xFFFFFFFF


def unmask_crc(masked: int) -> int:
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


# -- protobuf wire format ------------------------------------------------------------------------------------
class _Corrupt(Exception):
    pass


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Corrupt("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) of a protobuf message: ints for varint/fixed, bytes for length-delimited."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise _Corrupt("truncated fixed64")
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise _Corrupt("truncated length-delimited field")
            value, pos = bytes(buf[pos : pos + size]), pos + size
        elif wire == 5:
            if pos + 4 > len(buf):
                raise _Corrupt("truncated fixed32")
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        else:
            raise _Corrupt(f"unsupported protobuf wire type {wire}")
        out.append((number, wire, value))
    return out


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _int(v, what: str) -> int:
    if not isinstance(v, int):
        raise _Corrupt(f"{what} is not a number")
    return v


def _message(v, what: str) -> bytes:
    if not isinstance(v, bytes):
        raise _Corrupt(f"{what} is not a message")
    return v


class TensorEntry:
    """Where one tensor lives in the bundle (a decoded BundleEntryProto)."""

    __slots__ = ("name", "dtype", "shape", "shard_id", "offset", "size", "crc32c", "sliced")

    def __init__(self, name: str, value: bytes):
        self.name, self.dtype, self.shape = name, 0, ()
        self.shard_id = self.offset = self.size = 0
        self.crc32c, self.sliced = None, False
        dims = []
        # Each field's wire type is checked: a damaged entry may put bytes where a number belongs, or the reverse.
        for number, _, v in _fields(value):
            if number == 1:
                self.dtype = _int(v, "dtype")
            elif number == 2:  # TensorShapeProto: repeated Dim (size = field 1) as field 2
                for n2, _, dim in _fields(_message(v, "shape")):
                    if n2 == 2:
                        size = next((s for n3, _, s in _fields(_message(dim, "a dimension")) if n3 == 1), 0)
                        dims.append(_signed64(_int(size, "a dimension's size")))
            elif number == 3:
                self.shard_id = _int(v, "shard_id")
            elif number == 4:
                self.offset = _signed64(_int(v, "offset"))
            elif number == 5:
                self.size = _signed64(_int(v, "size"))
            elif number == 6:
                self.crc32c = _int(v, "crc32c")
            elif number == 7:
                self.sliced = True
        self.shape = tuple(dims)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, f"dtype {self.dtype}")


class TFCheckpoint:
    """The tensors of a TensorFlow V2 checkpoint, read lazily: `names()`, `shape(name)`, `get_tensor(name)`.

    `prefix` is the checkpoint's path without extension (`.../model.ckpt-0`); the `.index` path works too.
    """

    def __init__(self, prefix, verify_checksums: bool = True):
        prefix = str(prefix)
        if prefix.endswith(".index"):
            prefix = prefix[: -len(".index")]
        self.prefix = prefix
        self.index_path = Path(prefix + ".index")
        self.verify_checksums = verify_checksums
        try:
            data = self.index_path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(self.index_path, "TensorFlow checkpoint index not found") from None
        except OSError as e:
            raise CheckpointError(self.index_path, f"cannot read ({e.strerror or e})") from None
        try:
            self.num_shards, self.entries = self._read_index(data)
        except _Corrupt as e:
            raise CheckpointError(self.index_path, f"truncated or corrupt TensorFlow checkpoint index ({e})") from None
        self._shard_sizes: dict[int, int] = {}

    # -- the table -------------------------------------------------------------------------------------------
    def _block(self, data: bytes, offset: int, size: int) -> bytes:
        end = offset + size
        if offset < 0 or end + BLOCK_TRAILER_SIZE > len(data):
            raise _Corrupt(f"block at {offset} (+{size} bytes) runs past the end of the file")
        block = data[offset:end]
        kind, masked = data[end], struct.unpack_from("<I", data, end + 1)[0]
        if crc32c(block + bytes([kind])) != unmask_crc(masked):
            raise _Corrupt(f"checksum mismatch in the block at byte {offset}")
        if kind != 0:
            raise _Corrupt(f"compressed blocks (type {kind}) are not supported; TensorFlow writes uncompressed ones")
        return block

    @staticmethod
    def _block_entries(block: bytes):
        if len(block) < 4:
            raise _Corrupt("block too short")
        n_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
        end = len(block) - 4 - 4 * n_restarts
        if end < 0:
            raise _Corrupt("bad restart array")
        pos, key = 0, b""
        while pos < end:
            shared, pos = _varint(block, pos)
            fresh, pos = _varint(block, pos)
            vsize, pos = _varint(block, pos)
            if shared > len(key) or pos + fresh + vsize > end:
                raise _Corrupt("bad block entry")
            key = key[:shared] + block[pos : pos + fresh]
            pos += fresh
            yield key, block[pos : pos + vsize]
            pos += vsize

    def _read_index(self, data: bytes):
        if len(data) < FOOTER_SIZE:
            raise _Corrupt(f"{len(data)} bytes, shorter than the table footer")
        footer = data[-FOOTER_SIZE:]
        if struct.unpack_from("<Q", footer, FOOTER_SIZE - 8)[0] != TABLE_MAGIC:
            raise _Corrupt("no table magic number at the end (not a TensorFlow V2 .index file, or cut short)")
        pos = 0
        _, pos = _varint(footer, pos)  # metaindex offset
        _, pos = _varint(footer, pos)  # metaindex size
        index_offset, pos = _varint(footer, pos)
        index_size, pos = _varint(footer, pos)
        header, entries = None, {}
        for _, handle in self._block_entries(self._block(data, index_offset, index_size)):
            offset, p = _varint(handle, 0)
            size, _ = _varint(handle, p)
            for key, value in self._block_entries(self._block(data, offset, size)):
                if key == b"":
                    header = _fields(value)
                else:
                    name = key.decode("utf-8", "replace")
                    entries[name] = TensorEntry(name, value)
        if header is None:
            raise _Corrupt("no bundle header")
        num_shards, endianness = 1, 0
        for number, _, v in header:
            if number == 1:
                num_shards = _int(v, "num_shards")
            elif number == 2:
                endianness = _int(v, "endianness")
        if endianness != 0:
            raise _Corrupt("big-endian bundles are not supported")
        return num_shards, entries

    # -- tensors ---------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name].shape

    def data_bytes(self) -> int:
        """Bytes of the data shards that exist: a bound on what anything derived from the index may take."""
        return sum(p.stat().st_size for p in map(self.shard_path, range(min(self.num_shards, 1 << 16)))
                   if p.is_file())

    def shard_path(self, shard_id: int) -> Path:
        return Path(f"{self.prefix}.data-{shard_id:05d}-of-{self.num_shards:05d}")

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (float32 for bfloat16); errors name the file at fault."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(self.index_path, f"has no tensor {name!r}")
        if entry.sliced:
            raise CheckpointError(self.index_path, f"tensor {name!r} is saved in slices (a partitioned variable), "
                                                   "which is not supported")
        if entry.dtype not in DTYPES:
            raise CheckpointError(self.index_path, f"tensor {name!r} has {entry.dtype_name} elements, "
                                                   "which are not supported")
        dtype = DTYPES[entry.dtype]
        if len(entry.shape) > MAX_RANK or min(entry.shape, default=0) < 0:
            raise CheckpointError(self.index_path, f"tensor {name!r} has shape {list(entry.shape)[:8]}"
                                                   f"{'...' if len(entry.shape) > 8 else ''}")
        count = math.prod(entry.shape)  # Python ints: a product of claimed dimensions must not wrap around
        if entry.size != count * dtype.itemsize:
            raise CheckpointError(self.index_path, f"tensor {name!r}: {entry.size} bytes do not fit shape "
                                                   f"{list(entry.shape)} of {entry.dtype_name}")
        if not 0 <= entry.shard_id < self.num_shards:
            raise CheckpointError(self.index_path, f"tensor {name!r} is in shard {entry.shard_id} of a bundle with "
                                                   f"{self.num_shards}")
        path = self.shard_path(entry.shard_id)
        try:
            with open(path, "rb") as f:
                # the claimed range against the shard's own size, before a byte is allocated for it
                have = os.fstat(f.fileno()).st_size
                if entry.offset < 0 or entry.offset + entry.size > have:
                    raise CheckpointError(path, f"truncated: tensor {name!r} needs bytes {entry.offset}.."
                                                f"{entry.offset + entry.size}, the file holds {have}")
                f.seek(entry.offset)
                raw = f.read(entry.size)
        except FileNotFoundError:
            raise CheckpointError(path, "TensorFlow checkpoint data shard not found") from None
        except OSError as e:
            raise CheckpointError(path, f"cannot read ({e.strerror or e})") from None
        if len(raw) != entry.size:
            raise CheckpointError(path, f"truncated: tensor {name!r} needs bytes {entry.offset}.."
                                        f"{entry.offset + entry.size}, the file ends before")
        if self.verify_checksums and entry.crc32c is not None and crc32c(raw) != unmask_crc(entry.crc32c):
            raise CheckpointError(path, f"corrupt: tensor {name!r} fails its crc32c check")
        array = np.frombuffer(raw, dtype=dtype).reshape(entry.shape)
        if entry.dtype == DT_BFLOAT16:
            array = (array.astype(np.uint32) << 16).view(np.float32)
        return array.copy()


def is_tf_checkpoint(path) -> bool:
    """`path` is a checkpoint prefix (`model.ckpt-N`) or its `.index` / `.data-*` file."""
    p = str(path)
    if ".data-" in Path(p).name:
        p = p[: p.rindex(".data-")]
    if p.endswith(".index"):
        p = p[: -len(".index")]
    return Path(p + ".index").is_file()
