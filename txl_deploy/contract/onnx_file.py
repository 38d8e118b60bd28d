"""ONNX files at the protobuf wire level, for the two jobs that must not hold a whole model in memory.

- `read_metadata`: a model's `metadata_props` without parsing its graph. `onnx.load` of a single-file 1.1 GB model
  builds the whole ModelProto (weights included) in Python memory just to read a few kilobytes of metadata.
- `write_inline`: turn a model whose weights live in external data files into one self-contained file, one tensor
  at a time. `onnx.save` would first build the complete ModelProto and then its serialised bytes: twice the
  weights in memory on top of the model that produced them.
- `external_data`: every external data file a model names, each checked to lie inside the model's folder. Every
  path that lets a library read a model's external data calls it first (see docs/security.md).

The wire format (protobuf encoding, https://protobuf.dev/programming-guides/encoding/) lets a message be written
field by field in any order: the fields of onnx.proto3 used here are ModelProto.graph (7), ModelProto.metadata_props
(14), GraphProto.node (1), GraphProto.initializer (5) and TensorProto.raw_data (9), external_data (13) and
data_location (14). `external_data` also walks every place onnx.proto3 lets a tensor sit: ModelProto.functions (25),
GraphProto.sparse_initializer (15), NodeProto.attribute (5), FunctionProto.node (7) and attribute_proto (11),
AttributeProto.t (5), g (6), tensors (10), graphs (11), sparse_tensor (22), sparse_tensors (23), and
SparseTensorProto.values (1) and indices (2).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import StringStringEntryProto

from txl_deploy.errors import CheckpointError

MODEL_GRAPH, MODEL_METADATA = 7, 14
GRAPH_NODE, GRAPH_INITIALIZER = 1, 5
TENSOR_RAW_DATA = 9
WIRE_LEN = 2  # wire type of length-delimited fields
_COPY_BYTES = 64 << 20


def varint(n: int) -> bytes:
    """`n` as a protobuf varint."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire_type: int = WIRE_LEN) -> bytes:
    return varint(field << 3 | wire_type)


class CutShort(ValueError):
    """The file ends inside a field: what a copy or download that stopped early leaves."""


def _read_varint(f) -> int | None:
    shift, value = 0, 0
    while True:
        b = f.read(1)
        if not b:
            if shift:
                raise CutShort("truncated varint")  # the file itself ended inside the number
            return None  # clean end of the message
        value |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _file_size(f) -> int | None:
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # an in-memory file
        return None


def _damaged(f, end: int, problem: str, whole_fields: bool) -> ValueError:
    """The error for a field that does not fit its message: CutShort when that message runs to the file's end and
    fields before it were read whole (a file of something else than protobuf rarely gets that far)."""
    return CutShort(problem) if whole_fields and end == _file_size(f) else ValueError(problem)


def unreadable(e: Exception) -> str:
    """Why a file is not a readable ONNX model, in words, for an error message."""
    if isinstance(e, CutShort):
        return ("not a readable ONNX model: it looks cut short (the file ends inside a field; was it copied or "
                "downloaded completely?)")
    detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"not a readable ONNX model ({type(e).__name__}{': ' + detail if detail else ''})"


def wire_fields(f, start: int, end: int):
    """(field number, wire type, field offset, payload offset, payload end) of each field of the message in
    f[start:end], read lazily; a varint field's payload is empty (its value is not needed). The caller may seek
    between fields. Raises ValueError on a damaged message."""
    pos = start
    while pos < end:
        f.seek(pos)
        try:
            tag = _read_varint(f)
        except ValueError as e:
            raise _damaged(f, end, str(e), pos > start) from None
        if tag is None:
            raise _damaged(f, end, "truncated message", pos > start)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == 0:
            if _read_varint(f) is None:
                raise _damaged(f, end, "truncated varint", pos > start)
            size = 0
        elif wire == 1:
            size = 8
        elif wire == 5:
            size = 4
        elif wire == WIRE_LEN:
            size = _read_varint(f)
            if size is None:
                raise _damaged(f, end, "truncated length", pos > start)
        else:  # groups (3, 4) are not in onnx.proto; 6 and 7 do not exist
            raise ValueError(f"wire type {wire}")
        payload = f.tell()
        if payload + size > end:
            raise _damaged(f, end, "field runs past the end of its message", pos > start)
        at, pos = pos, payload + size
        yield field, wire, at, payload, pos


def _fields(f, end: int):
    """(field number, wire type, payload offset, payload length) of each length-delimited field of the message in
    f[tell():end]."""
    for field, wire, _, start, stop in wire_fields(f, f.tell(), end):
        if wire == WIRE_LEN:
            yield field, wire, start, stop - start


def _entry(f, start: int, size: int) -> StringStringEntryProto:
    """The key/value entry (a metadata property, an external_data pair) in f[start:start + size]."""
    f.seek(start)
    entry = StringStringEntryProto()
    try:
        entry.ParseFromString(f.read(size))
    except DecodeError as e:  # not a ValueError: the readers' callers expect one for a damaged file
        raise ValueError(f"a damaged key/value entry ({e})") from None
    return entry


def read_metadata(path) -> tuple[dict[str, str], bool]:
    """(metadata_props as a dict, whether the graph has a node) of the ONNX file at `path`.

    Reads the metadata entries and the graph's field headers only; weights are skipped by seeking. Raises
    ValueError on a file that is not a protobuf ModelProto with a graph."""
    props, has_graph, has_node = {}, False, False
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        for field, _, start, size in list(_fields(f, end)):
            if field == MODEL_METADATA:
                entry = _entry(f, start, size)
                props[entry.key] = entry.value
            elif field == MODEL_GRAPH:
                has_graph = True
                f.seek(start)
                has_node = has_node or any(g == GRAPH_NODE for g, *_ in _fields(f, start + size))
    if not has_graph:
        raise ValueError("no graph")
    return props, has_node


def write_inline(src, dst) -> None:
    """Write the model at `src` (weights in external data files beside it) to `dst` as one file, streaming each
    tensor's bytes from its data file. The result parses to the same ModelProto as `onnx.load(src)` with the data
    moved into `raw_data`."""
    src = Path(src)
    checked = {(e.location, e.offset, e.length): e for e in external_data(src)}
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    pieces = []  # (bytes of the TensorProto without its data, data file or None, offset, length)
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            ref = checked[(info["location"], int(info.get("offset", 0)),
                           int(info["length"]) if "length" in info else None)]
            location, offset, length = ref.path, ref.offset, ref.size
            head = onnx.TensorProto()
            head.CopyFrom(t)
            head.ClearField("external_data")
            head.ClearField("data_location")
            pieces.append((head.SerializeToString() + _key(TENSOR_RAW_DATA) + varint(length), location, offset,
                           length))
        else:
            pieces.append((t.SerializeToString(), None, 0, 0))
    del graph.initializer[:]
    rest_of_graph = graph.SerializeToString()
    fields = [_key(GRAPH_INITIALIZER) + varint(len(head) + length) for head, _, _, length in pieces]
    graph_size = len(rest_of_graph) + sum(len(k) + len(h) + n for k, (h, _, _, n) in zip(fields, pieces))
    model.ClearField("graph")
    with open(dst, "wb") as out:
        out.write(model.SerializeToString())
        out.write(_key(MODEL_GRAPH) + varint(graph_size))
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


def weight_file_bytes(onnx_path) -> int:
    """Bytes of an exported graph's weights: the .onnx file and the external data files it names (checked by
    `external_data`: a location outside the model's folder is refused, not measured)."""
    path = Path(onnx_path)
    files = {ref.path for ref in external_data(path)}
    return path.stat().st_size + sum(f.stat().st_size for f in files)


# -- external data: what a model may make a library read ---------------------------------------------------------
MODEL_FUNCTIONS = 25
GRAPH_SPARSE_INITIALIZER = 15
NODE_ATTRIBUTE = 5
FUNCTION_NODE, FUNCTION_ATTRIBUTE_PROTO = 7, 11
ATTR_T, ATTR_G, ATTR_TENSORS, ATTR_GRAPHS, ATTR_SPARSE_TENSOR, ATTR_SPARSE_TENSORS = 5, 6, 10, 11, 22, 23
SPARSE_VALUES, SPARSE_INDICES = 1, 2
TENSOR_EXTERNAL_DATA = 13
_MAX_NESTING = 64  # subgraphs inside subgraphs; protobuf itself refuses more than 100 levels
_MAX_ENTRY_BYTES = 64 << 10  # one external_data key/value pair: a path and a few numbers
_DRIVE = re.compile(r"[A-Za-z]:")


@dataclass(frozen=True)
class ExternalData:
    """One tensor's external data, checked: `path` is the file inside the model's folder, `size` the bytes read."""

    location: str  # as the model names it (relative to the model's folder)
    path: Path
    offset: int
    length: int | None  # as the model names it (None: to the end of the file)
    size: int


def external_data(model_path) -> list[ExternalData]:
    """Every external data reference of the ONNX model at `model_path`, each checked before any library follows it.

    A location must be relative, contain no `..`, and name a regular file that lies inside the model's folder once
    symlinks are resolved; that file must have one link only, since a hard link to a file elsewhere cannot be told
    from a file of the folder by its path; offset and length must lie inside the file. Any other location raises
    CheckpointError naming the model and the location. Reads the file's protobuf fields without parsing the graph
    (weights are skipped by seeking), in initializers, sparse initializers and attribute tensors of the graph, its
    subgraphs and its functions: every tensor onnx or ONNX Runtime could fill from a file."""
    model_path = Path(model_path)
    refs: list[ExternalData] = []
    try:
        with open(model_path, "rb") as f:
            end = os.fstat(f.fileno()).st_size
            for field, _, start, size in _fields(f, end):
                if field == MODEL_GRAPH:
                    _walk_graph(f, start + size, refs, model_path, 0)
                elif field == MODEL_FUNCTIONS:
                    _walk_function(f, start + size, refs, model_path, 0)
    except CheckpointError:
        raise
    except (ValueError, OSError, RecursionError) as e:
        raise CheckpointError(model_path, unreadable(e)) from None
    return refs


def _walk_graph(f, end, refs, model_path, depth):
    if depth > _MAX_NESTING:
        raise CheckpointError(model_path, f"subgraphs nested more than {_MAX_NESTING} deep")
    for field, _, start, size in _fields(f, end):
        if field == GRAPH_INITIALIZER:
            _walk_tensor(f, start + size, refs, model_path)
        elif field == GRAPH_SPARSE_INITIALIZER:
            _walk_sparse(f, start + size, refs, model_path)
        elif field == GRAPH_NODE:
            _walk_node(f, start + size, refs, model_path, depth, NODE_ATTRIBUTE)


def _walk_function(f, end, refs, model_path, depth):
    for field, _, start, size in _fields(f, end):
        if field == FUNCTION_NODE:
            _walk_node(f, start + size, refs, model_path, depth, NODE_ATTRIBUTE)
        elif field == FUNCTION_ATTRIBUTE_PROTO:
            _walk_attribute(f, start + size, refs, model_path, depth)


def _walk_node(f, end, refs, model_path, depth, attribute_field):
    for field, _, start, size in _fields(f, end):
        if field == attribute_field:
            _walk_attribute(f, start + size, refs, model_path, depth)


def _walk_attribute(f, end, refs, model_path, depth):
    for field, _, start, size in _fields(f, end):
        if field in (ATTR_T, ATTR_TENSORS):
            _walk_tensor(f, start + size, refs, model_path)
        elif field in (ATTR_SPARSE_TENSOR, ATTR_SPARSE_TENSORS):
            _walk_sparse(f, start + size, refs, model_path)
        elif field in (ATTR_G, ATTR_GRAPHS):
            _walk_graph(f, start + size, refs, model_path, depth + 1)


def _walk_sparse(f, end, refs, model_path):
    for field, _, start, size in _fields(f, end):
        if field in (SPARSE_VALUES, SPARSE_INDICES):
            _walk_tensor(f, start + size, refs, model_path)


def _walk_tensor(f, end, refs, model_path):
    entries = {}
    for field, _, start, size in _fields(f, end):
        if field == TENSOR_EXTERNAL_DATA:
            if size > _MAX_ENTRY_BYTES:
                raise CheckpointError(model_path, f"an external_data entry of {size} bytes")
            entry = _entry(f, start, size)
            entries[entry.key] = entry.value
    # Checked whether or not data_location says EXTERNAL: what a reader ignores today, another may follow.
    if entries:
        refs.append(_checked(model_path, entries))


def _checked(model_path: Path, entries: dict) -> ExternalData:
    location = entries.get("location")

    def refuse(problem):
        raise CheckpointError(model_path, f"external data location {location!r} {problem}; a model's external "
                                          "data must be files inside its own folder")

    if not location:
        refuse("is empty")
    if "\0" in location:
        refuse("contains a NUL character")
    parts = re.split(r"[\\/]", location)
    if location.startswith(("/", "\\")) or os.path.isabs(location) or _DRIVE.match(location):
        refuse("is an absolute path")
    if ".." in parts:
        refuse("contains '..'")
    folder = model_path.parent
    target = folder / location
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(target)
    if os.path.commonpath([real_folder, real]) != real_folder:
        refuse(f"resolves to {real}, outside the model's folder (a symbolic link)")
    try:
        st = os.stat(real)
    except OSError as e:
        refuse(f"cannot be read ({e.strerror or e})")
    if not stat.S_ISREG(st.st_mode):
        refuse("is not a regular file")
    if st.st_nlink > 1:
        refuse(f"is a file with {st.st_nlink} hard links, which may be a file outside the folder; copy it (cp) to "
               "give the model its own file")
    try:
        offset = int(entries.get("offset", 0))
        length = int(entries["length"]) if "length" in entries else None
    except ValueError:
        refuse("has an offset or length that is not a number")
    if offset < 0 or (length is not None and length < 0):
        refuse("has a negative offset or length")
    size = st.st_size - offset if length is None else length
    if offset + size > st.st_size or size < 0:
        refuse(f"claims bytes {offset}..{offset + size}, but the file holds {st.st_size}")
    return ExternalData(location, target, offset, length, size)


__all__ = ["read_metadata", "write_inline", "external_data", "weight_file_bytes", "ExternalData", "varint",
           "wire_fields"]
