"""examples/onnxruntime_driver.py, written from the README contract alone, against TxlRuntime on the demo model.

Both layouts, fp32 and fp16, batch 2: a prefill into an empty memory, decode steps, a segment longer than mem_len
(the ring wraps and only its last mem_len entries count), a reset of one row while the other keeps its memory,
and more steps after it. Tolerances on the max abs log-prob difference: 1e-5 in fp32 and 5e-3 in fp16 (log-probs
reach magnitude ~18, where fp16 steps are 0.0156). Both sides run the same graph, but TxlRuntime feeds an empty
memory as one slot and zeroes a reset row where the driver keeps mem_len slots and the stale ring, so the kernels
may differ; observed: 0.0 in all four cases (ONNX Runtime 1.32, x86-64).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from helpers.paths import ROOT

from txl_deploy.assets import demo_model_path
from txl_deploy.runtimes import TxlRuntime

DRIVER = ROOT / "examples" / "onnxruntime_driver.py"
TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3}


def _load_driver():
    spec = importlib.util.spec_from_file_location("onnxruntime_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_graphs(demo_onnx, tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.exporters.precision.convert import reduce_onnx

    root = tmp_path_factory.mktemp("driver")
    out = {("fp32", "incremental"): demo_onnx,  # conftest's default export, shared with the demo's tests
           ("fp32", "full"): root / "demo-full.onnx"}
    export_onnx(demo_model_path(), out[("fp32", "full")], state="full")
    for state in ("incremental", "full"):
        out[("fp16", state)] = root / f"demo-{state}-fp16.onnx"
        reduce_onnx(out[("fp32", state)], out[("fp16", state)], precision="fp16")
    return out


def test_the_driver_never_imports_txl_deploy():
    tree = ast.parse(DRIVER.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "argparse", "json", "numpy", "onnxruntime"}, imported


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("state", ["incremental", "full"])
def test_driver_matches_txlruntime_across_a_wrap_and_a_reset(demo_graphs, precision, state):
    path = demo_graphs[(precision, state)]
    driver = _load_driver().Driver(str(path), batch=2)
    assert driver.layout == state and driver.mem_len == 128
    assert driver.state_dtype == (np.float16 if precision == "fp16" else np.float32)
    rng = np.random.default_rng(7)
    worst = 0.0
    with TxlRuntime.load(path, providers=["cpu"]) as rt:
        # 40 + 1 + 150 = 191 > mem_len 128: the ring wraps, and the 150-token segment exceeds mem_len itself
        for i, q in enumerate([40, 1, 150, 1, "reset", 3, 1, 20, 1]):
            if q == "reset":
                rt.reset(rows=[1])
                driver.reset_row(1)
                continue
            tokens = rng.integers(0, rt.n_token, size=(2, q))
            ours, ref = driver.step(tokens), rt.step(tokens)
            assert ours.shape == ref.shape == (2, q, rt.n_token) and ours.dtype == np.float32
            worst = max(worst, float(np.abs(ours - ref).max()))
        assert list(driver.mem["mem_count"]) == [217, 25]  # row 1 restarted at the reset
    assert worst <= TOLERANCE[precision], worst


def test_reset_row_ignores_what_the_ring_still_holds(demo_graphs):
    """A fresh stream after a reset (count 0, stale ring) equals one in a brand-new memory."""
    Driver = _load_driver().Driver
    path = str(demo_graphs[("fp32", "incremental")])
    rng = np.random.default_rng(3)
    used = Driver(path, batch=1)
    used.step(rng.integers(0, 73, size=(1, 200)))
    used.reset_row(0)
    assert np.abs(used.mem["mem_k.0"]).max() > 0  # the stale contents are still there
    tokens = rng.integers(0, 73, size=(1, 30))
    np.testing.assert_allclose(used.step(tokens), Driver(path, batch=1).step(tokens), atol=1e-5)


def test_driver_command_line_generates_what_txlruntime_generates(demo_graphs):
    path = demo_graphs[("fp32", "incremental")]
    # txl_deploy is made unimportable in the driver's process: the example stands on the README alone.
    code = ("import sys, runpy; sys.modules['txl_deploy'] = None; "
            f"sys.argv = ['driver', {str(path)!r}, '--prompt', 'And God said', '--max-new-tokens', '30']; "
            f"runpy.run_path({str(DRIVER)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with TxlRuntime.load(path, providers=["cpu"]) as rt:
        expected = "And God said" + rt.decode(list(rt.generate("And God said", max_new_tokens=30, temperature=0)))
    assert r.stdout.rstrip("\n") == expected
