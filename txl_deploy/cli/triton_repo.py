"""`txl-deploy triton-repo`: a Triton Inference Server model repository for an exported graph or engine."""

from __future__ import annotations

import click

from txl_deploy.serving.triton.repository import write_repository


@click.command("triton-repo")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="Folder to write the Triton model repository to.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "python"]), default=None,
              help="Triton backend: onnxruntime (a .onnx exported with --state full), tensorrt (an engine from "
                   "build-engine), or python (TxlRuntime inside Triton's Python backend; any exported model). "
                   "Default: onnxruntime for .onnx, tensorrt for engines.")
@click.option("--name", default="txl", show_default=True, help="Model name inside the repository.")
@click.option("--max-batch", type=int, default=8, show_default=True,
              help="Most conversations batched into one model execution (Triton max_batch_size).")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Model instances (copies of the model, each with its own conversations).")
@click.option("--max-sequences", type=int, default=None,
              help="Live conversations per instance (oldest strategy max_candidate_sequences). More new "
                   "conversations wait in Triton's backlog until one ends or idles out. Default: 4 x --max-batch.")
@click.option("--idle-timeout", type=float, default=300.0, show_default=True,
              help="Seconds without a request after which Triton drops a conversation and its memory.")
@click.option("--max-queue-delay-us", type=int, default=1000, show_default=True,
              help="How long the sequence batcher may hold a request to fill a batch (microseconds). Longer means "
                   "fuller batches and more latency: a fraction of one decode step is a good setting.")
@click.option("--threads", type=int, default=None,
              help="python backend: ONNX Runtime threads per model instance (default: ONNX Runtime's, one per "
                   "core). On a machine shared with other work, 1 per instance avoids oversubscribing the cores.")
@click.option("--force", is_flag=True, help="Overwrite an existing output folder.")
def triton_repo(model, out, backend, name, max_batch, instances, max_sequences, idle_timeout, max_queue_delay_us,
                threads, force):
    """Write a Triton Inference Server model repository for MODEL (an exported .onnx or a TensorRT engine).

    Every conversation is a Triton sequence whose memory stays on the server between requests (implicit state
    for onnxruntime/tensorrt; for python, the conversations' memories are the rows of one batched TxlRuntime
    state, one runtime call per Triton batch, and a conversation can be parked and resumed on another server).
    The repository's README.md says how to start Triton on it and how much memory each conversation takes.
    """
    write_repository(model, out, force=force, backend=backend, name=name, max_batch=max_batch,
                     instances=instances, max_sequences=max_sequences, idle_timeout=idle_timeout,
                     max_queue_delay_us=max_queue_delay_us, threads=threads)


COMMANDS = [triton_repo]
