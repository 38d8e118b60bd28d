"""One module per CLI command group; each exposes `COMMANDS`, a list of click commands. Keep imports of torch,
onnxruntime and tensorrt inside the command functions."""
