"""Runtimes: one `TxlRuntime` interface over ONNX Runtime, TensorRT and PyTorch (eager reference and cached).

The ONNX Runtime and TensorRT backends import numpy and their engine only, never torch (edge devices).
"""

from .base import BACKENDS, Backend, TxlRuntime, sample

__all__ = ["TxlRuntime", "Backend", "BACKENDS", "sample"]
