"""A model's external data must stay inside its folder: every path that lets a library read it refuses a location
that is absolute, contains `..`, resolves outside the folder through a symbolic link, or is a hard link; the error
names the model and the location, and nothing outside the folder is read or copied.

The crafted models are the tiny export with its largest weight moved to an external data file named by the
location under test. "Read" is watched with a Python audit hook (every `open`, by path and by inode): the check
runs before any library (onnx, ONNX Runtime, TensorRT's parser, shutil) is handed the model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from audit import Watch
from click.testing import CliRunner

from txl_deploy.cli import main
from txl_deploy.contract.onnx_file import external_data, weight_file_bytes, write_inline
from txl_deploy.errors import CheckpointError

SECRET = b"the contents of a file outside the model's folder " * 200

def craft(model_onnx: Path, folder: Path, location: str, data_file: Path | None = None) -> Path:
    """`folder/model.onnx`: the model with its largest initializer in external data at `location`; the tensor's
    bytes are written to `data_file` when given."""
    folder.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(model_onnx))
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    raw = tensor.raw_data
    if data_file is not None:
        data_file.parent.mkdir(parents=True, exist_ok=True)
        data_file.write_bytes(raw)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(raw)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    return path


KINDS = ("absolute", "dotdot", "symlink", "hardlink")


def escaping_model(kind: str, model_onnx: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    """(model, the secret outside its folder, the location the model names) for one way of escaping."""
    secret = tmp_path / "outside" / "secret.bin"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(SECRET)
    folder = tmp_path / "model"
    if kind == "absolute":
        location = str(secret)
    elif kind == "dotdot":
        location = "../outside/secret.bin"
    else:
        location = "weights.bin"
    path = craft(model_onnx, folder, location)
    if kind == "symlink":
        os.symlink(secret, folder / location)
    elif kind == "hardlink":
        os.link(secret, folder / location)
    return path, secret, location


def assert_refused(call, model: Path, location: str, secret: Path, exc=CheckpointError):
    with Watch() as watch, pytest.raises(exc) as err:
        call()
    message = str(err.value)
    assert str(model) in message and repr(location) in message, message
    assert "inside its own folder" in message
    assert not watch.touched(secret), f"opened {secret}"
    return message


@pytest.mark.parametrize("kind", KINDS)
def test_the_check_refuses_each_way_out_with_the_file_and_the_location(kind, tiny_onnx, tmp_path):
    model, secret, location = escaping_model(kind, tiny_onnx, tmp_path)
    message = assert_refused(lambda: external_data(model), model, location, secret)
    assert {"absolute": "absolute path", "dotdot": "contains '..'", "symlink": "outside the model's folder",
            "hardlink": "2 hard links"}[kind] in message


@pytest.mark.parametrize("kind", KINDS)
def test_runtime_verify_inline_and_info_refuse_before_reading(kind, tiny_onnx, tiny_ckpt, tmp_path):
    from txl_deploy.exporters.onnx.verify import verify_file
    from txl_deploy.runtimes import TxlRuntime

    model, secret, location = escaping_model(kind, tiny_onnx, tmp_path)
    assert_refused(lambda: TxlRuntime.load(model), model, location, secret)
    assert_refused(lambda: verify_file(model, tiny_ckpt), model, location, secret)
    assert_refused(lambda: write_inline(model, tmp_path / "inline.onnx"), model, location, secret)
    assert not (tmp_path / "inline.onnx").exists()
    assert_refused(lambda: weight_file_bytes(model), model, location, secret)
    for args in (["info", str(model)], ["info", str(model), "--memory"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and repr(location) in result.output, result.output


@pytest.mark.parametrize("kind", KINDS)
def test_exporters_refuse_and_write_nothing(kind, tiny_onnx, tmp_path):
    from txl_deploy.exporters.precision.convert import reduce_onnx
    from txl_deploy.exporters.tensorrt.build import build_engine
    from txl_deploy.exporters.web.site import write_site

    model, secret, location = escaping_model(kind, tiny_onnx, tmp_path)
    out = tmp_path / "out"
    assert_refused(lambda: reduce_onnx(model, out / "fp16.onnx", precision="fp16", verify=False), model, location,
                   secret)
    assert_refused(lambda: write_site(model, out / "site"), model, location, secret)
    # the check comes before TensorRT is imported: this runs on machines without it too
    assert_refused(lambda: build_engine(model, out / "model.engine"), model, location, secret)
    assert not out.exists()


@pytest.mark.parametrize("backend", ["python", "onnxruntime", "tensorrt"])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_repo_copies_nothing_from_outside(kind, backend, tiny_onnx, tmp_path):
    import json

    from txl_deploy.contract.engine_file import SIDECAR_FORMAT, SIDECAR_VERSION
    from txl_deploy.contract.metadata import read_onnx_info
    from txl_deploy.serving.triton.repository import write_repository

    model, secret, location = escaping_model(kind, tiny_onnx, tmp_path)
    served = model
    if backend == "tensorrt":  # an engine whose sidecar names the crafted graph (its I/O types are read from it)
        info = read_onnx_info(tiny_onnx)
        served = model.parent / "model.engine"
        served.write_bytes(b"an engine")
        meta = {"format": SIDECAR_FORMAT, "format_version": SIDECAR_VERSION, "tensorrt_version": "10.3.0",
                "precision": "fp32", "batch": [1, 1, 4], "segment": [1, 8, 16], "config": info.config.to_dict(),
                "vocab": info.vocab.to_dict(), "export": {**info.export, "state": "full"}, "onnx": model.name}
        (model.parent / "model.engine.json").write_text(json.dumps(meta))
    repo = tmp_path / "repo"
    assert_refused(lambda: write_repository(served, repo, backend=backend), model, location, secret)
    args = ["triton-repo", str(served), "-o", str(tmp_path / "repo2"), "--backend", backend]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and repr(location) in result.output, result.output
    assert not repo.exists() and not (tmp_path / "repo2").exists()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent not in (secret.parent, model.parent)]
    assert not any(SECRET[:64] in p.read_bytes() for p in written), written


def test_data_inside_the_folder_is_read_and_travels_with_the_model(tiny_onnx, tmp_path):
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.serving.triton.repository import write_repository

    folder = tmp_path / "model"
    model = craft(tiny_onnx, folder, "weights/big.bin", folder / "weights" / "big.bin")
    (ref,) = external_data(model)
    assert ref.path == folder / "weights" / "big.bin" and ref.offset == 0 and ref.size == ref.length > 0
    assert weight_file_bytes(model) == model.stat().st_size + ref.size
    tokens = np.array([[3, 1, 4, 1, 5]])
    with TxlRuntime.load(model) as rt, TxlRuntime.load(tiny_onnx) as inline:
        np.testing.assert_array_equal(rt.step(tokens), inline.step(tokens))
    # a symbolic link that stays inside the folder is followed
    os.rename(folder / "weights" / "big.bin", folder / "weights" / "real.bin")
    os.symlink("real.bin", folder / "weights" / "big.bin")
    assert external_data(model)[0].size == ref.size
    # triton-repo keeps the location the model names, so the copied model finds its data
    repo = write_repository(model, tmp_path / "repo", backend="python")
    copied = repo / "txl" / "1"
    assert (copied / "weights" / "big.bin").read_bytes() == (folder / "weights" / "real.bin").read_bytes()
    with TxlRuntime.load(copied / "model.onnx") as rt, TxlRuntime.load(tiny_onnx) as inline:
        np.testing.assert_array_equal(rt.step(tokens), inline.step(tokens))


def test_claimed_ranges_must_lie_inside_the_data_file(tiny_onnx, tmp_path):
    folder = tmp_path / "model"
    model = craft(tiny_onnx, folder, "w.bin", folder / "w.bin")
    size = (folder / "w.bin").stat().st_size
    m = onnx.load(str(model), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.external_data)
    for offset, length, problem in [("0", str(2**40), f"but the file holds {size}"), ("-4", "4", "negative"),
                                    ("x", "4", "not a number"), (str(size), "1", f"but the file holds {size}")]:
        for e in t.external_data:
            e.value = {"offset": offset, "length": length}.get(e.key, e.value)
        onnx.save(m, str(model))
        with pytest.raises(CheckpointError, match=problem):
            external_data(model)


def test_every_place_a_tensor_can_sit_is_checked(tiny_onnx, tmp_path):
    """External data in a Constant node's attribute, inside a subgraph (If branch), in a sparse initializer and in
    a function: each is found and refused when it points out."""
    from onnx import helper

    def external_tensor(name, location):
        t = helper.make_tensor(name, onnx.TensorProto.FLOAT, [1], [0.0])
        t.ClearField("float_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        entry = t.external_data.add()
        entry.key, entry.value = "location", location
        return t

    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    const = lambda loc: helper.make_node("Constant", [], ["y"], value=external_tensor("c", loc))  # noqa: E731
    branch = helper.make_graph([const("../branch.bin")], "branch", [], [out])
    cases = {
        "attribute": helper.make_graph([const("../attr.bin")], "g", [], [out]),
        "subgraph": helper.make_graph(
            [helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)], "g",
            [helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])], [out]),
        "sparse": helper.make_graph(
            [helper.make_node("Identity", ["s"], ["y"])], "g", [], [out],
            sparse_initializer=[helper.make_sparse_tensor(external_tensor("s", "../sparse.bin"),
                                                          helper.make_tensor("i", onnx.TensorProto.INT64, [1], [0]),
                                                          [1])]),
    }
    for what, graph in cases.items():
        path = tmp_path / what / "model.onnx"
        path.parent.mkdir()
        onnx.save(helper.make_model(graph), str(path))
        with pytest.raises(CheckpointError, match=r"'\.\./(attr|branch|sparse)\.bin' contains '\.\.'"):
            external_data(path)
    function = helper.make_function("local", "f", [], ["y"], [const("../function.bin")],
                                    [helper.make_opsetid("", 18)])
    model = helper.make_model(helper.make_graph([helper.make_node("f", [], ["y"], domain="local")], "g", [], [out]),
                              functions=[function])
    path = tmp_path / "function" / "model.onnx"
    path.parent.mkdir()
    onnx.save(model, str(path))
    with pytest.raises(CheckpointError, match="function.bin"):
        external_data(path)
