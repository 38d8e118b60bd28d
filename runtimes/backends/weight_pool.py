"""The pool of weights an ONNX Runtime CPU backend holds once for all its sessions (see `SharedWeights`).

A model's graph and its adaptive-softmax parts repeat tensors (the head graph repeats the body and the tied
embedding, each tail graph its cluster's rows). Reading each graph through protobuf's wire format
(`contract.onnx_file`) puts every weight straight from its file into one numpy array, merges equal ones, and hands
ONNX Runtime the graph without its weights plus the arrays to use in their place.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from txl_deploy.contract.onnx_file import (
    GRAPH_INITIALIZER,
    MODEL_GRAPH,
    TENSOR_RAW_DATA,
    WIRE_LEN,
    varint,
    wire_fields,
)

# Tensors under this many bytes stay in their graph: the pool is for weights, and a graph's small constants (shapes,
# indices, scalars) are read by ONNX Runtime's optimisers as they are.
SHARED_MIN_BYTES = 1 << 16
_IN_MEMORY = "txl-deploy: held by the backend"  # the location a pooled initializer names in the graph given to ORT


class SharedWeights:
    """The weights of a model and of its part graphs, each distinct tensor held once (numpy arrays).

    `attach(path, opts)` reads the graph at `path` tensor by tensor (protobuf's wire format: the weights go straight
    from the file, or from its external data file, into arrays, never through a whole ModelProto), merges every
    tensor equal to one already held (same dtype, shape and bytes), and returns the graph without its weights,
    for ONNX Runtime, with `opts` giving the session the held arrays in their place. Two calls of SessionOptions do
    that: `add_external_initializers` lets the graph optimisers read the values (the graph refers to the arrays'
    memory), `add_initializer` makes the session use the arrays as they are (without it the session copies
    them). A tail graph's `Gemm(hidden, W, transB=1)` whose W [rows, d] is the transpose of a held [d, rows] (the
    main graph's output weight, as its MatMul reads it) is given that array with transB=0.
    The arrays must outlive every session given them: the backend keeps this pool as long as its sessions."""

    def __init__(self, min_bytes: int = SHARED_MIN_BYTES):
        import onnxruntime as ort  # optional (the cpu or gpu extra)

        self.ort, self.min_bytes = ort, min_bytes
        self._held = {}  # fingerprint -> [(array, OrtValue)]
        self.read_bytes = 0  # bytes of the tensors read from files
        self.held_bytes = 0  # bytes held once merged

    def attach(self, path, opts) -> bytes:
        model, arrays = _read_weights_apart(Path(path), self.min_bytes)
        gemm_b = _only_gemm_b(model.graph)
        given = {}
        for name in list(arrays):
            array = arrays.pop(name)
            self.read_bytes += array.nbytes
            held = self._find(array)
            if held is None and name in gemm_b:
                held = self._find(array.T)
                if held is not None:  # the same weight, stored as the other operand layout: flip the Gemms
                    _transpose_gemm_b(model.graph, name, held[0].shape)
            given[name] = held if held is not None else self._hold(array)
        names = list(given)
        values = [given[n][1] for n in names]
        opts.add_external_initializers(names, values)
        for name, value in zip(names, values):
            opts.add_initializer(name, value)
        # The metadata (the vocabulary's JSON, 3 MB for WikiText-103) is read by the backend from the file; the
        # session would keep its own copies of it for good, and ONNX Runtime's wrapper the bytes given here.
        del model.metadata_props[:]
        return model.SerializeToString()

    def _find(self, array):
        """The held (array, OrtValue) equal to `array` (a view is compared as its values), or None."""
        return next((held for held in self._held.get(_fingerprint(array), ()) if np.array_equal(held[0], array)),
                    None)

    def _hold(self, array):
        entry = (array, self.ort.OrtValue.ortvalue_from_numpy(array))
        self._held.setdefault(_fingerprint(array), []).append(entry)
        self.held_bytes += array.nbytes
        return entry


def _only_gemm_b(graph) -> set:
    """Names of the graph's 2-D initializers used only as a Gemm's B (input 1)."""
    uses = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append(node.op_type == "Gemm" and i == 1)
    return {t.name for t in graph.initializer if len(t.dims) == 2 and uses.get(t.name) and all(uses[t.name])}


def _transpose_gemm_b(graph, name: str, shape) -> None:
    """Make `name` the transpose of what it was: its dims become `shape`, every Gemm reading it flips transB."""
    for node in graph.node:
        if node.op_type == "Gemm" and node.input[1] == name:
            trans_b = next((a for a in node.attribute if a.name == "transB"), None)
            if trans_b is None:
                node.attribute.append(onnx.helper.make_attribute("transB", 1))
            else:
                trans_b.i = 1 - trans_b.i
    tensor = next(t for t in graph.initializer if t.name == name)
    del tensor.dims[:]
    tensor.dims.extend(shape)


def _fingerprint(array) -> tuple:
    """A cheap key of an array's content: its dtype, shape and corner elements (equal arrays have equal keys)."""
    head = array[(slice(0, 8),) * array.ndim]
    tail = array[(slice(-8, None),) * array.ndim]
    return array.dtype.str, array.shape, np.ascontiguousarray(head).tobytes(), np.ascontiguousarray(tail).tobytes()


def _read_weights_apart(path: Path, min_bytes: int):
    """(the ModelProto at `path` with its initializers of `min_bytes` or more left without data, {name: array} of
    those initializers' values). The file is read once, each weight straight into its array; external data is
    read from the data file the tensor names (already checked to lie in the model's folder, `external_data`)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        out, arrays = bytearray(), {}
        for field, wire, at, start, end in wire_fields(f, 0, size):
            f.seek(at)
            if field != MODEL_GRAPH or wire != WIRE_LEN:
                out += f.read(end - at)
                continue
            graph = bytearray()
            for g_field, g_wire, g_at, g_start, g_end in wire_fields(f, start, end):
                tensor = None
                if g_field == GRAPH_INITIALIZER and g_wire == WIRE_LEN and (
                        g_end - g_start >= min_bytes or _is_external(f, g_start, g_end)):
                    # Every tensor of external data is read here: the graph ONNX Runtime gets is bytes, with no
                    # folder to find a data file in.
                    tensor = _tensor_apart(f, path, g_start, g_end, arrays)
                if tensor is None:
                    f.seek(g_at)
                    graph += f.read(g_end - g_at)
                else:
                    graph += varint(GRAPH_INITIALIZER << 3 | WIRE_LEN) + varint(len(tensor)) + tensor
            out += varint(MODEL_GRAPH << 3 | WIRE_LEN) + varint(len(graph)) + bytes(graph)
    return onnx.ModelProto.FromString(bytes(out)), arrays


def _is_external(f, start: int, end: int) -> bool:
    f.seek(start)
    return TensorProto.FromString(f.read(end - start)).data_location == TensorProto.EXTERNAL


def _tensor_apart(f, path: Path, start: int, end: int, arrays: dict):
    """The TensorProto in f[start:end] without its data (None if it is not a plain numeric tensor of raw or
    external data), its value read into `arrays`."""
    fields = wire_fields(f, start, end)
    header, raw = bytearray(), None
    for field, wire, at, p_start, p_end in fields:
        if field == TENSOR_RAW_DATA and wire == WIRE_LEN:
            raw = (p_start, p_end)
            continue
        f.seek(at)
        header += f.read(p_end - at)
    tensor = TensorProto.FromString(bytes(header))
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except (KeyError, TypeError, ValueError):
        return None
    if dtype.kind not in "biuf" or dtype.itemsize not in (1, 2, 4, 8) or tensor.data_type in (
            TensorProto.BFLOAT16, TensorProto.INT4, TensorProto.UINT4):
        return None
    n_bytes = int(np.prod(tensor.dims, dtype=np.int64)) * dtype.itemsize
    if tensor.data_location == TensorProto.EXTERNAL:
        entries = {e.key: e.value for e in tensor.external_data}
        if "location" not in entries or int(entries.get("length", n_bytes)) != n_bytes:
            return None
        source, offset = path.parent / entries["location"], int(entries.get("offset", 0))
    elif raw is not None and raw[1] - raw[0] == n_bytes:
        source, offset = None, raw[0]
    else:
        return None
    array = np.empty(tuple(tensor.dims), dtype=dtype.newbyteorder("<"))
    if source is None:
        f.seek(offset)
        got = f.readinto(memoryview(array.reshape(-1).view(np.uint8)))
    else:
        with open(source, "rb") as data:
            data.seek(offset)
            got = data.readinto(memoryview(array.reshape(-1).view(np.uint8)))
    if got != n_bytes:
        raise ValueError(f"{tensor.name}: {got} of its {n_bytes} bytes")
    arrays[tensor.name] = array
    tensor.ClearField("external_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", _IN_MEMORY
    return tensor.SerializeToString()
