"""The Triton Python model refuses oversized inputs by their shape, before it reads or allocates anything from them,
and reads a resume_state as untrusted; a refused request changes no conversation. In this process, over a stand-in
for Triton's stub (helpers/triton_stub.py); test_triton_flood.py does the same through a real tritonserver.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from crafted_files import Member, npy_header, state_zip
from helpers.triton_stub import Request, ShapeOnly, load_model_module, start_model

from txl_deploy.runtimes import TxlRuntime


@pytest.fixture(scope="module")
def model(tiny_onnx, tmp_path_factory):
    m = start_model(load_model_module(), tiny_onnx, tmp_path_factory.mktemp("triton") / "repo", max_batch=4,
                    max_sequences=8)
    yield m
    m.finalize()


def errors(responses):
    return [r.error for r in responses]


def test_oversized_inputs_are_refused_by_their_shape(model, tiny_onnx):
    alone = TxlRuntime.load(tiny_onnx)
    good = model.execute([Request(1, [5, 17, 42], [2], start=True)])[0]
    np.testing.assert_allclose(good.outputs["log_probs"][0, 0], alone.step([[5, 17, 42]])[0, -1], atol=1e-5)
    n = model.max_request_tokens
    tracemalloc.start()
    out = model.execute([
        Request(2, positions=[0], start=True, raw={"tokens": ShapeOnly("tokens", [1, 10**9])}),
        Request(3, [1], start=True, raw={"out_positions": ShapeOnly("out_positions", [1, n + 1])}),
        Request(4, [], [], start=True, raw={"resume_state": ShapeOnly("resume_state", [1, model.max_state_bytes + 1])}),
        Request(1, [7], [0]),  # a good request in the same batch
    ])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "tokens of shape [1, 1000000000] is longer than this server accepts" in out[0].error
    assert f"out_positions of shape [1, {n + 1}] is longer" in out[1].error
    assert f"larger than this server accepts per request ({model.max_state_bytes:,} bytes)" in out[2].error
    assert out[3].error is None
    np.testing.assert_allclose(out[3].outputs["log_probs"][0, 0], alone.step([[7]])[0, -1], atol=1e-5)
    assert peak < 1 << 20
    # the refused conversations never started; conversation 1 goes on exactly as alone
    assert set(model.conversations) == {1}
    again = model.execute([Request(1, [9, 10], [1])])[0]
    np.testing.assert_allclose(again.outputs["log_probs"][0, 0], alone.step([[9, 10]])[0, -1], atol=1e-5)
    model.execute([Request(1, [1], [0], end=True)])


def test_resume_state_is_read_as_untrusted(model, tiny_onnx):
    alone = TxlRuntime.load(tiny_onnx)
    model.execute([Request(10, [3, 1, 4], [2], start=True)])
    alone.step([[3, 1, 4]])
    parked = model.execute([Request(11, [2, 7], [1], start=True, end=True, want_state=True)])[0]
    blob = parked.outputs["saved_state"].tobytes()
    with TxlRuntime.load(tiny_onnx) as runtime:
        runtime.load_state(blob)  # what the model parks, the runtime reads (and so the model itself, below)
        state = runtime.save_state()
    state.update({"__format__": np.array("txl-deploy conversation state"), "__format_version__": np.array(1)})
    shape = (1 << 17,) + state["mem_k.0"].shape[1:]
    header = npy_header(shape)
    bad = {
        "bomb": state_zip(state, **{"mem_k.0": Member("mem_k.0.npy", b"", 8, declared_size=len(header) + 2**30,
                                                      compressed=b"\x03\x00")}),
        "two rows": state_zip({k: (np.concatenate([v, v]) if np.ndim(v) and not k.startswith("__") else v)
                               for k, v in state.items()}),
        "damaged": blob[: len(blob) // 2],
        "not a zip": b"\x00" * 64,
        "no format header": state_zip({k: v for k, v in state.items() if k != "__format__"}),
        "another model": state_zip({**state, "__fingerprint__": np.array("kv-0000000000000000-float32")}),
    }
    tracemalloc.start()
    out = model.execute([Request(20 + i, [], [], start=True, resume=b) for i, b in enumerate(bad.values())]
                        + [Request(10, [5], [0])])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    for what, response in zip(bad, out):
        assert response.error is not None and "resume_state" in response.error, (what, response.error)
    assert "expands to" in out[0].error and "at most 1 is accepted" in out[1].error
    assert "another model" in out[5].error and "header" in out[4].error
    assert peak < 2 << 20
    assert not {20, 21, 22, 23, 24, 25} & set(model.conversations)
    np.testing.assert_allclose(out[-1].outputs["log_probs"][0, 0], alone.step([[5]])[0, -1], atol=1e-5)
    # and a good parked state still resumes
    resumed = model.execute([Request(30, [8], [0], start=True, resume=blob)])[0]
    with TxlRuntime.load(tiny_onnx) as runtime:
        runtime.step([[2, 7]])
        np.testing.assert_allclose(resumed.outputs["log_probs"][0, 0], runtime.step([[8]])[0, -1], atol=1e-5)
    model.execute([Request(10, [1], [0], end=True), Request(30, [1], [0], end=True)])
