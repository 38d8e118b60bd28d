"""ONNX files at the protobuf wire level, for the two jobs that must not hold a whole model in memory.

- `read_metadata`: a model's `metadata_props` without parsing its graph. `onnx.load` of a single-file 1.1 GB model
  builds the whole ModelProto (weights included) in Python memory just to read a few kilobytes of metadata.
- `write_inline`: turn a model whose weights live in external data files into one self-contained file, one tensor
  at a time. `onnx.save` would first build the complete ModelProto and then its serialised bytes: twice the
  weights in memory on top of the model that produced them.

The wire format (protobuf encoding, https://protobuf.dev/programming-guides/encoding/) lets a message be written
field by field in any order: the fields of onnx.proto3 used here are ModelProto.graph (7), ModelProto.metadata_props
(14), GraphProto.node (1), GraphProto.initializer (5) and TensorProto.raw_data (9), external_data (13) and
data_location (14).
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx import StringStringEntryProto

MODEL_GRAPH, MODEL_METADATA = 7, 14
GRAPH_NODE, GRAPH_INITIALIZER = 1, 5
TENSOR_RAW_DATA = 9
_LEN = 2  # wire type of length-delimited fields
_COPY_BYTES = 64 << 20


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire_type: int = _LEN) -> bytes:
    return _varint(field << 3 | wire_type)


def _read_varint(f) -> int | None:
    shift, value = 0, 0
    while True:
        b = f.read(1)
        if not b:
            if shift:
                raise ValueError("truncated varint")
            return None  # clean end of the message
        value |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(f, end: int):
    """(field number, wire type, payload offset, payload length) of each field of the message in f[tell():end]."""
    while f.tell() < end:
        tag = _read_varint(f)
        if tag is None:
            raise ValueError("truncated message")
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == 0:
            _read_varint(f)
            continue
        if wire == 1:
            size = 8
        elif wire == 5:
            size = 4
        elif wire == _LEN:
            size = _read_varint(f)
            if size is None:
                raise ValueError("truncated length")
        else:  # groups (3, 4) are not in onnx.proto; 6 and 7 do not exist
            raise ValueError(f"wire type {wire}")
        start = f.tell()
        if start + size > end:
            raise ValueError("field runs past the end of its message")
        if wire == _LEN:
            yield field, wire, start, size
        f.seek(start + size)


def read_metadata(path) -> tuple[dict[str, str], bool]:
    """(metadata_props as a dict, whether the graph has a node) of the ONNX file at `path`.

    Reads the metadata entries and the graph's field headers only; weights are skipped by seeking. Raises
    ValueError on a file that is not a protobuf ModelProto with a graph."""
    props, has_graph, has_node = {}, False, False
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        for field, _, start, size in list(_fields(f, end)):
            if field == MODEL_METADATA:
                f.seek(start)
                entry = StringStringEntryProto()
                entry.ParseFromString(f.read(size))
                props[entry.key] = entry.value
            elif field == MODEL_GRAPH:
                has_graph = True
                f.seek(start)
                has_node = has_node or any(g == GRAPH_NODE for g, *_ in _fields(f, start + size))
    if not has_graph:
        raise ValueError("no graph")
    return props, has_node


def _external(tensor, base: Path) -> tuple[Path, int, int]:
    info = {e.key: e.value for e in tensor.external_data}
    location = base / info["location"]
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else location.stat().st_size - offset
    return location, offset, length


def write_inline(src, dst) -> None:
    """Write the model at `src` (weights in external data files beside it) to `dst` as one file, streaming each
    tensor's bytes from its data file. The result parses to the same ModelProto as `onnx.load(src)` with the data
    moved into `raw_data`."""
    src = Path(src)
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    pieces = []  # (bytes of the TensorProto without its data, data file or None, offset, length)
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location, offset, length = _external(t, src.parent)
            head = onnx.TensorProto()
            head.CopyFrom(t)
            head.ClearField("external_data")
            head.ClearField("data_location")
            pieces.append((head.SerializeToString() + _key(TENSOR_RAW_DATA) + _varint(length), location, offset,
                           length))
        else:
            pieces.append((t.SerializeToString(), None, 0, 0))
    del graph.initializer[:]
    rest_of_graph = graph.SerializeToString()
    fields = [_key(GRAPH_INITIALIZER) + _varint(len(head) + length) for head, _, _, length in pieces]
    graph_size = len(rest_of_graph) + sum(len(k) + len(h) + n for k, (h, _, _, n) in zip(fields, pieces))
    model.ClearField("graph")
    with open(dst, "wb") as out:
        out.write(model.SerializeToString())
        out.write(_key(MODEL_GRAPH) + _varint(graph_size))
        out.write(rest_of_graph)
        for key, (head, location, offset, length) in zip(fields, pieces):
            out.write(key)
            out.write(head)
            if location is not None:
                with open(location, "rb") as data:
                    data.seek(offset)
                    _copy(data, out, length, location)


def _copy(src, dst, n: int, name) -> None:
    while n:
        chunk = src.read(min(n, _COPY_BYTES))
        if not chunk:
            raise ValueError(f"{name}: external data ends early")
        dst.write(chunk)
        n -= len(chunk)


__all__ = ["read_metadata", "write_inline"]


def weight_file_bytes(onnx_path) -> int:
    """Bytes of an exported graph's weights: the .onnx file and its external data files (a few MB of graph)."""
    path = Path(onnx_path)
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())
