"""What `txl-deploy bench` measures: a runtime backend against the PyTorch eager reference, side by side
(`run_benchmark`), its report (`report`), random-weight stand-ins of the published shapes (`random_weights`), the
bandwidth floor of a decode step (`bandwidth_floor`) and ONNX Runtime's profile by op type (`op_profile`). The
other benchmarks live in the checkout's `benchmarks` package (docs/benchmarks.md)."""

from txl_deploy.bench.benchmark import run_benchmark

__all__ = ["run_benchmark"]
