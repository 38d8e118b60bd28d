"""TensorRT engines against ONNX Runtime, on a GPU (skipped with the reason where TensorRT or a GPU is missing).

Tolerances on log-probabilities (max absolute difference over a multi-segment stream, a tiny random model whose
log-probs are around -log(V)):
- fp32 engine: 1e-3 (TF32 is disabled for fp32 builds; what remains is kernel summation order);
- fp16 engine: 5e-2 (the same fp16 ONNX under ONNX Runtime is the reference, not the fp32 graph);
- int8 engine: 0.25 against the int8 Q/DQ ONNX under ONNX Runtime (TensorRT fuses Q/DQ into int8 kernels that
  round differently from ORT's reference Q -> DQ -> float op chain).
NVIDIA/TensorRT#4813 (a silently wrong strongly typed FP32 engine in 11.1) is why these comparisons exist at all.
"""

import numpy as np
import pytest

from txl_deploy.contract.engine_file import TensorRTMissing, gpu_info


def _gpu_reason():
    """Why these tests cannot run here: TensorRT not installed, or no cuda-python or no usable GPU (what
    `gpu_info` reports as TensorRTMissing). Anything else (a TensorRT install that fails to import, a bug in
    `gpu_info`) is raised, so a GPU machine fails instead of skipping."""
    try:
        import tensorrt  # noqa: F401  (the tensorrt extra: GPU machines only)
    except ModuleNotFoundError as e:
        if e.name != "tensorrt":  # TensorRT is there but something it imports is not: a broken install
            raise
        return "TensorRT is not installed (pip install 'txl-deploy[tensorrt]')"
    try:
        gpu_info()
    except TensorRTMissing as e:
        return str(e)
    return None


REASON = _gpu_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

MAX_SEGMENT = 8
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "int8": 0.25}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny random model exported with the full state layout (what TensorRT engines are built from)."""
    import torch

    from txl_deploy.checkpoints.native import save_checkpoint
    from txl_deploy.config import TxlConfig
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.model.mem_transformer import MemTransformerLM

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("trt")
    cfg = TxlConfig(n_token=50, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, mem_len=12, tgt_len=4)
    save_checkpoint(root / "ckpt", MemTransformerLM(cfg).eval(), None)
    export_onnx(root / "ckpt", root / "fp32.onnx", state="full", max_segment=MAX_SEGMENT)
    return root


def _onnx_for(exported, precision):
    if precision == "fp32":
        return exported / "fp32.onnx"
    from txl_deploy.exporters.precision import convert as reduced

    path = exported / f"{precision}.onnx"
    if not path.exists():
        calib = np.random.default_rng(1).integers(0, 50, size=400)
        reduced.reduce_onnx(exported / "fp32.onnx", path, precision=precision, calib=calib)
    return path


def _engine_for(exported, precision):
    from txl_deploy.exporters.tensorrt.build import build_engine

    path = exported / f"{precision}.engine"
    if not path.exists():
        build_engine(_onnx_for(exported, precision), path, precision=precision, batch=(1, 2, 2),
                     segment=(1, 1, MAX_SEGMENT), progress=False)
    return path


def _stream(rt, segments):
    out = []
    for seg in segments:
        out.append(rt.step(seg))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_engine_matches_onnxruntime_over_a_stream(exported, precision):
    from txl_deploy.runtimes import TxlRuntime

    engine = _engine_for(exported, precision)
    assert engine.with_name(engine.name + ".json").is_file()
    rng = np.random.default_rng(0)
    # Segments of 8, 3 and 1 tokens: the memory (12 slots) wraps around within the stream.
    segments = [rng.integers(0, 50, size=(2, q)) for q in (8, 3, 1, 8, 1, 1)]
    with TxlRuntime.load(_onnx_for(exported, precision)) as ref, TxlRuntime.load(engine) as rt:
        assert rt.backend.name == "tensorrt"
        want, got = _stream(ref, segments), _stream(rt, segments)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOLERANCE[precision]


def test_fp32_engine_greedy_tokens_equal_onnxruntime(exported):
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(exported / "fp32.onnx") as ref, TxlRuntime.load(_engine_for(exported, "fp32")) as rt:
        want = list(ref.generate([1, 2, 3], max_new_tokens=100, temperature=0))
        got = list(rt.generate([1, 2, 3], max_new_tokens=100, temperature=0))
    assert got == want and len(got) == 100


def test_fp32_engine_beam_search_equals_onnxruntime(exported):
    """The beams are the engine's rows, reordered on the device each step (select_rows into its spare set): the
    same hypotheses as ONNX Runtime, scores within the fp32 tolerance summed over the steps."""
    from txl_deploy.runtimes import TxlRuntime

    args = {"num_beams": 2, "max_new_tokens": 12, "num_return_sequences": 2, "stop": [0]}  # 2 rows: the profile's
    with TxlRuntime.load(exported / "fp32.onnx") as ref, TxlRuntime.load(_engine_for(exported, "fp32")) as rt:
        want, got = ref.beam_search([1, 2, 3], **args), rt.beam_search([1, 2, 3], **args)
        assert rt.batch_size == 1  # the stream holds the prompt again
    assert [b.tokens for b in got] == [b.tokens for b in want]
    assert np.allclose([b.score for b in got], [b.score for b in want], rtol=0, atol=12 * TOLERANCE["fp32"])


def test_memory_stays_on_the_device(exported):
    """Per decode step only the tokens and positions go up and the log-probs come down."""
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(_engine_for(exported, "fp32")) as rt:
        backend = rt.backend
        rt.step([[1, 2, 3]])
        for _ in range(3):  # the 2nd decode step onwards replays CUDA graphs
            up, down = backend.bytes_to_device, backend.bytes_to_host
            rt.step([[7]])
            assert backend.bytes_to_device - up == 2 * 8  # one int64 token + one int64 position
            assert backend.bytes_to_host - down == 50 * backend.tensors["log_probs"][1].itemsize
        assert backend.cuda_graphs and any(s.graphs for s in backend._states)  # decode was captured


def test_engine_from_another_gpu_or_version_is_refused(exported, tmp_path):
    import json
    import shutil

    from txl_deploy.errors import CheckpointError
    from txl_deploy.runtimes import TxlRuntime

    engine = _engine_for(exported, "fp32")
    copy = tmp_path / "other.engine"
    shutil.copy(engine, copy)
    meta = json.loads(engine.with_name(engine.name + ".json").read_text())
    meta["tensorrt_version"] = "9.9.9"
    copy.with_name(copy.name + ".json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="built with TensorRT 9.9.9"):
        TxlRuntime.load(copy)
