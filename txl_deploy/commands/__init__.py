"""One module per CLI command group; each exposes `COMMANDS`, a list of click commands. Keep imports of torch,
onnxruntime and tensorrt inside the command functions."""

import click

THREADS_HELP = ("CPU threads: ONNX Runtime's intra-op threads (one inter-op thread) and torch.set_num_threads for "
                "the PyTorch side. No effect on a TensorRT engine, which runs on the GPU (a warning says so). "
                "[default: each library's own, one thread per core]")


def threads_option(f):
    """`--threads N`, the same on every command that runs a model (passed to `TxlRuntime.load(threads=N)`)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)(f)
