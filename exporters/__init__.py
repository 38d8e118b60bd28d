"""Exporters: ONNX (with reduced precision variants), TensorRT engines, Triton model repositories."""
