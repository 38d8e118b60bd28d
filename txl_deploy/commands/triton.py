"""`txl-deploy triton-repo` (write a Triton model repository) and `txl-deploy serve-client` (talk to it)."""

from __future__ import annotations

import sys

import click


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
    from txl_deploy.exporters.triton import write_repository

    write_repository(model, out, force=force, log=click.echo, backend=backend, name=name, max_batch=max_batch,
                     instances=instances, max_sequences=max_sequences, idle_timeout=idle_timeout,
                     max_queue_delay_us=max_queue_delay_us, threads=threads)


@click.command("serve-client")
@click.argument("url")
@click.option("--prompt", required=True, help="Text that starts the conversation.")
@click.option("--model", default="txl", show_default=True, help="Model name in the Triton repository.")
@click.option("--max-new-tokens", type=int, default=50, show_default=True, help="Tokens to generate.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy decoding.")
@click.option("--top-k", type=int, default=None, help="Sample only among the k most likely tokens.")
@click.option("--top-p", type=float, default=None, help="Sample only within this probability mass (nucleus).")
@click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible output).")
@click.option("--vocab", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Vocabulary file (REPO/MODEL/vocab.json) when the server's model config does not carry it.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for each request.")
def serve_client(url, prompt, model, max_new_tokens, temperature, top_k, top_p, seed, vocab, timeout):
    """Generate text from a Triton server at URL (http://HOST:PORT or grpc://HOST:PORT), streaming tokens as
    they arrive. The conversation is one Triton sequence, ended when generation stops."""
    from txl_deploy.serve_client import TxlTritonClient

    client = TxlTritonClient(url, model=model, vocab=vocab, timeout=timeout)
    if client.vocab is None:
        from txl_deploy.errors import InputError

        raise InputError(f"model {model!r} publishes no vocabulary: pass --vocab REPO/{model}/vocab.json")
    first = True
    for tok in client.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed):
        piece = client.vocab.decode([tok])
        if client.vocab.kind == "word" and not first and piece != "\n":
            piece = " " + piece
        first = piece == "\n"
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    client.close()


COMMANDS = [triton_repo, serve_client]
