"""Exporters: ONNX graphs with the memory as explicit I/O, reduced-precision variants, TensorRT engines.

Heavy dependencies (torch, onnxruntime, tensorrt) are imported inside the functions that need them."""
