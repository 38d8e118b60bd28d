"""Runtimes: one `TxlRuntime` interface over ONNX Runtime, TensorRT and PyTorch (eager reference and cached).

`runtime` is the interface users call, `backend` the contract each engine implements, `registry` picks and opens
a backend for a file, `sampling` chooses tokens (one `SamplingParams` for every path), `beam_search` keeps k beams
as k memory rows, `evaluation` scores a text as the paper does; `backends/` holds one module per engine. The ONNX Runtime and TensorRT backends import numpy
and their engine only, never torch (edge devices).
"""

from txl_deploy.runtimes.backend import Backend
from txl_deploy.runtimes.beam_search import Beam
from txl_deploy.runtimes.registry import BACKENDS
from txl_deploy.runtimes.runtime import TxlRuntime
from txl_deploy.runtimes.sampling import Sampler, SamplingParams, sample

__all__ = ["TxlRuntime", "Backend", "Beam", "BACKENDS", "SamplingParams", "Sampler", "sample"]
