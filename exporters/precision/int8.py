"""int8: static symmetric Q/DQ calibrated on a stream with the memory carried (TensorRT), and ONNX Runtime's dynamic
int8 MatMuls (CPUs)."""

from __future__ import annotations

import logging

import numpy as np
import onnx

from txl_deploy.exporters.precision.folding import weight_matmuls
from txl_deploy.progress import progress_bar
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

logger = logging.getLogger(__name__)

CALIB_BATCH = 4  # the calibration text is read as this many parallel streams (each threads its own memory)


class StreamingCalibration:
    """ONNX Runtime CalibrationDataReader: the calibration text streamed through the fp32 graph with its memory.

    The text is split into `batch` contiguous streams read side by side in segments of `seg` tokens; before
    each segment the reader hands the quantizer the graph's full input (tokens + the current memory), then
    advances the memory with the fp32 graph itself (the ONNX Runtime backend of TxlRuntime), so the ranges the
    calibrator sees are those of a model reading with a filled memory."""

    def __init__(self, fp32_path, ids: np.ndarray, seg: int, batch: int = CALIB_BATCH, progress=None, threads=None):
        self.backend = OrtBackend(fp32_path, providers=["cpu"], intra_op_threads=threads)
        n = ids.size // seg  # whole segments
        batch = max(1, min(batch, n))
        per_row = (n // batch) * seg
        self.streams = ids[: per_row * batch].reshape(batch, per_row)
        self.seg, self.pos = seg, 0
        self.state = self.backend.new_state(batch)
        self.positions = np.ascontiguousarray(np.broadcast_to(np.arange(seg, dtype=np.int64), (batch, seg)))
        self.n_segments = per_row // seg
        self.progress = progress

    def get_next(self):
        if self.pos > 0:  # advance the memory over the segment the quantizer just saw
            prev = self.streams[:, self.pos - self.seg:self.pos]
            self.backend.run(self.state, np.ascontiguousarray(prev), self.positions)
            if self.progress is not None:
                self.progress.update(1)
        if self.pos >= self.streams.shape[1]:
            return None
        tokens = np.ascontiguousarray(self.streams[:, self.pos:self.pos + self.seg])
        self.pos += self.seg
        feeds = {k: np.array(v, copy=True) for k, v in self.backend.state_arrays(self.state).items()}
        feeds["tokens"], feeds["out_positions"] = tokens, self.positions
        return feeds

    def close(self):
        self.backend.close()


def quantize_int8(fp32_path, out_path, calib_ids, seg: int, threads=None):
    """Static symmetric Q/DQ quantization of the weight MatMuls, calibrated by streaming `calib_ids`."""
    # optional (the cpu or gpu extra)
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    model = onnx.load(str(fp32_path), load_external_data=False)
    nodes = weight_matmuls(model)
    with progress_bar(desc="calibrating", unit="segment") as bar:
        reader = StreamingCalibration(fp32_path, calib_ids, seg, progress=bar, threads=threads)
        bar.total = reader.n_segments
        logger.info(f"calibrating {len(nodes)} weight MatMuls on {reader.streams.size} tokens "
                    f"({reader.streams.shape[0]} streams x {reader.n_segments} segments of {seg}, memory threaded through)")
        try:
            quantize_static(
                str(fp32_path), str(out_path), reader, quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                op_types_to_quantize=["MatMul", "Gemm"], nodes_to_quantize=nodes,
                calibrate_method=CalibrationMethod.MinMax,
                extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
            )
        finally:
            reader.close()


def quantize_int8_dynamic(fp32_path, out_path, per_channel: bool = False):
    """ONNX Runtime dynamic int8 quantization of the weight MatMuls (MatMulInteger / DynamicQuantizeLinear)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # optional (the cpu or gpu extra)

    model = onnx.load(str(fp32_path), load_external_data=False)
    quantize_dynamic(str(fp32_path), str(out_path), op_types_to_quantize=["MatMul"],
                     nodes_to_quantize=weight_matmuls(model), per_channel=per_channel, weight_type=QuantType.QInt8)
