"""How every ONNX file an export writes is saved: the main graph, its reduced-precision conversions and the adaptive
softmax's parts alike.

The weights first go to an external data file, `<file name>.data`, tensor by tensor; every check reads the graph
from there (`check_strict`); then a graph that fits protobuf's 2 GB limit becomes one self-contained file
(`onnx_file.write_inline`, streaming), and a larger one keeps its data file, which `place_external_data` moves
beside the output. One rule, here, decides which files keep external data: a part that holds most of the model (the
body + head graph repeats the body and the tied embedding) crosses the limit with it.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from txl_deploy.contract.onnx_file import external_data, weight_file_bytes, write_inline
from txl_deploy.errors import ExportError
from txl_deploy.exporters.graph_checks import check_strict
from txl_deploy.files import check_writable

EXTERNAL_DATA_BYTES = 2_000_000_000  # protobuf's 2 GB limit (2 GiB), with a margin for the graph's own fields


def data_location(path) -> str:
    """The external data file of the graph at `path`, as the graph names it (beside it)."""
    return Path(path).name + ".data"


def needs_external_data(path) -> bool:
    """Whether the graph at `path` (weights in external data files or not) is too large to be one protobuf."""
    return weight_file_bytes(path) >= EXTERNAL_DATA_BYTES


def finish(path, what: str) -> None:
    """Check the graph at `path`, whose weights are in `<file name>.data` beside it (`check_strict`: nothing is
    written that a strict consumer refuses), then make it one file if it fits in a protobuf."""
    check_strict(path, what)
    if not needs_external_data(path):
        path = Path(path)
        data_files = {ref.path for ref in external_data(path)}
        one = path.with_name(path.name + ".inline")
        write_inline(path, one)
        os.replace(one, path)
        for data in data_files:
            data.unlink()


def save_checked(model: onnx.ModelProto, path, what: str) -> None:
    """Save an onnx.ModelProto at `path` the way every exported file is saved (`finish`): how every exporter that
    holds a ModelProto ends. The model's weights move to the data file as they are written (onnx.save_model's
    external data), so `model` is left without them."""
    path = Path(path)
    (path.parent / data_location(path)).unlink(missing_ok=True)  # onnx appends to an existing data file
    try:
        # Tensors under 1 kB (onnx's default threshold) stay in the graph: shape inference reads shape constants.
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_location(path))
    except Exception as e:  # a full disk, a tensor protobuf cannot hold, ...
        raise ExportError(f"{what}: cannot be written ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from e
    finish(path, what)


def place_external_data(tmp, out_path, force: bool) -> None:
    """Move the external data files written beside `tmp` (named after it) beside `out_path`."""
    tmp, out_path = Path(tmp), Path(out_path)
    for extra in tmp.parent.iterdir():
        if extra.name != tmp.name and extra.name.startswith(tmp.name):
            os.replace(extra, check_writable(out_path.parent / (out_path.name + extra.name[len(tmp.name):]), force))


__all__ = [
    "EXTERNAL_DATA_BYTES",
    "data_location",
    "finish",
    "needs_external_data",
    "place_external_data",
    "save_checked",
]
