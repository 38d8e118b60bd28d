"""Latency benchmarks: a runtime backend against the PyTorch eager reference, measured side by side.

`run_benchmark` (benchmark.py) is what `txl-deploy bench` calls; `report` formats its JSON as a table and a plot;
`standin` builds random-weight models of the published shapes; `floor` is the bandwidth bound of a decode step;
`profile` summarises ONNX Runtime's profiler by op type.
"""

from txl_deploy.bench.benchmark import run_benchmark

__all__ = ["run_benchmark"]
