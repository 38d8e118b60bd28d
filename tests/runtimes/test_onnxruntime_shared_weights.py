"""The ONNX Runtime backend holds each weight once: the model's graph and its adaptive-softmax head and tail graphs
share one pool of arrays (tied weights, the body the head graph repeats, each tail's transposed output weight), and
the sessions given that pool compute what sessions reading their own files compute, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper, TensorProto

from txl_deploy.contract import parts as parts_contract
from txl_deploy.runtimes.backends import onnxruntime as backend_module
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend
from txl_deploy.runtimes.backends.weight_pool import SharedWeights


def _plain(path):
    """A session reading the file itself, with the backend's kernels (no prepacking)."""
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _initializer_bytes(path) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in onnx.load(str(path)).graph.initializer)


@pytest.fixture(scope="module")
def shared(tiny_onnx):
    """The tiny adaptive model's backend with every tensor of 256 bytes or more in the pool."""
    mp = pytest.MonkeyPatch()
    mp.setattr(backend_module, "SHARED_MIN_BYTES", 256)
    try:
        yield OrtBackend(tiny_onnx, providers=["cpu"], intra_op_threads=1)
    finally:
        mp.undo()


def _part_files(backend, path):
    """The softmax parts' files the backend opened beside `path`, head first (as the backend finds them)."""
    return parts_contract.Parts.from_export(backend.info.export, backend.config, path).files(path)


def test_the_parts_add_no_weights_to_the_main_graphs(shared, tiny_onnx):
    assert shared.clusters is not None and len(shared._tails) == shared.config.n_clusters
    pool = shared.weights
    files = [tiny_onnx, *_part_files(shared, tiny_onnx)]
    # Every graph's tensors were read; the head repeats the body and the embedding, the tails their clusters' rows
    assert pool.read_bytes > 1.5 * _initializer_bytes(tiny_onnx)
    assert pool.held_bytes <= _initializer_bytes(tiny_onnx), (pool.held_bytes, [_initializer_bytes(f) for f in files])


def test_sessions_on_the_pool_compute_what_their_files_compute(shared, tiny_onnx):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shared.config.n_token, size=(2, 5))
    positions = np.tile(np.arange(5), (2, 1))
    feeds = {**shared.new_state(2), "tokens": tokens, "out_positions": positions}
    for ours, path in [(shared.session, tiny_onnx), (shared._head, _part_files(shared, tiny_onnx)[0])]:
        names = [o.name for o in ours.get_outputs()]
        for got, want in zip(ours.run(names, feeds), _plain(path).run(names, feeds)):
            np.testing.assert_array_equal(got, want)
    hidden = rng.standard_normal((3, shared.config.d_model)).astype(np.float32)
    head_log_prob = np.log(rng.uniform(0.1, 0.9, size=3)).astype(np.float32)
    for i, path in enumerate(_part_files(shared, tiny_onnx)[1:], start=1):
        feeds = {parts_contract.HIDDEN: hidden, parts_contract.HEAD_LOG_PROB: head_log_prob}
        (want,) = _plain(path).run(None, feeds)
        np.testing.assert_allclose(shared.run_tail(i, hidden, head_log_prob), want, rtol=1e-6, atol=1e-6)


def _gemm_model(path, weight, trans_b: int):
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=trans_b)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", weight.shape[1 if trans_b else 0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def test_a_gemm_weight_stored_transposed_is_the_held_array_with_trans_b_flipped(tmp_path):
    w = np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32)  # [d, rows]
    _gemm_model(tmp_path / "a.onnx", w, trans_b=0)
    _gemm_model(tmp_path / "b.onnx", np.ascontiguousarray(w.T), trans_b=1)  # [rows, d], as a tail stores it
    pool = SharedWeights(min_bytes=256)
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    outs = []
    for name in ("a.onnx", "b.onnx"):
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.disable_prepacking", "1")
        outs.append(ort.InferenceSession(pool.attach(tmp_path / name, opts), opts,
                                         providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])
    assert pool.read_bytes == 2 * w.nbytes and pool.held_bytes == w.nbytes
    np.testing.assert_allclose(outs[0], x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1], x @ w, rtol=1e-5, atol=1e-5)


def test_weights_in_an_external_data_file_are_read_into_the_pool(tmp_path):
    w = np.random.default_rng(3).standard_normal((32, 16)).astype(np.float32)
    path = tmp_path / "ext.onnx"
    _gemm_model(path, w, trans_b=0)
    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.onnx.data", size_threshold=0)
    pool = SharedWeights(min_bytes=1 << 20)  # every external tensor is read whatever its size
    opts = ort.SessionOptions()
    session = ort.InferenceSession(pool.attach(path, opts), opts, providers=["CPUExecutionProvider"])
    x = np.ones((2, 32), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)
    assert pool.held_bytes == w.nbytes


def test_prepack_gives_each_session_its_own_weights_and_the_same_log_probs(tiny_onnx, shared):
    prepacked = OrtBackend(tiny_onnx, providers=["cpu"], intra_op_threads=1, prepack=True)
    assert prepacked.weights is None and prepacked.clusters is not None
    tokens = np.random.default_rng(4).integers(0, shared.config.n_token, size=(1, 6))
    positions = np.arange(6)[None]
    got = prepacked.run(prepacked.new_state(1), tokens, positions)
    want = shared.run(shared.new_state(1), tokens, positions)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # other kernels, the same model


def test_a_quantized_graph_is_prepacked_by_default_and_fp32_is_not(tiny_onnx, shared, tmp_path):
    # int4's MatMulNBits without its packed weights unpacks every weight to fp32 at every call (several times
    # slower); a quantized graph's packed copies are small, so its sessions prepack and keep their own weights.
    from txl_deploy.exporters.precision.convert import reduce_onnx  # imports torch (the export side)

    int4 = tmp_path / "int4.onnx"
    reduce_onnx(tiny_onnx, int4, precision="int4")
    assert not shared.prepack and shared.weights is not None
    packed = OrtBackend(int4, providers=["cpu"], intra_op_threads=1)
    assert packed.prepack and packed.weights is None
    unpacked = OrtBackend(int4, providers=["cpu"], intra_op_threads=1, prepack=False)
    assert not unpacked.prepack and unpacked.weights is not None
    tokens = np.random.default_rng(5).integers(0, shared.config.n_token, size=(1, 6))
    positions = np.arange(6)[None]
    # The kernels differ: prepacked MatMulNBits quantizes each activation block to int8 (accuracy_level 4), the
    # unpacked one multiplies by the weights unpacked to fp32; both are the same 4-bit weights, far closer to each
    # other than the int4 gate against fp32 (0.1 nats a position).
    a = packed.run(packed.new_state(1), tokens, positions).astype(np.float64)
    b = unpacked.run(unpacked.new_state(1), tokens, positions).astype(np.float64)
    kl = float(np.mean(np.sum(np.exp(b) * (b - a), axis=-1)))
    assert kl < 0.01 and (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8, kl
