"""`txl-deploy serve`: an OpenAI-compatible HTTP API (completions, streaming, sessions) over one model or a Triton
fleet."""

from __future__ import annotations

import os
from pathlib import Path

import click

from txl_deploy.checkpoints.hub import HubReference
from txl_deploy.cli.options import (
    ModelReference,
    local_model,
    threads_option,
    tokenizer_option,
    use_tokenizer,
    with_tokenizer,
)
from txl_deploy.errors import InputError, install_hint
from txl_deploy.runtimes import TxlRuntime

API_KEY_ENV = "TXL_API_KEY"


@click.command("serve")
@click.argument("model", type=ModelReference(click.Path(exists=True)), required=False)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; put a proxy with TLS in front).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@threads_option
@click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Rows generating at once (one per request, n or best_of for one that asks for several "
                   "completions; more: 400); more requests wait in the queue.")
@click.option("--max-sessions", type=click.IntRange(min=1), default=64, show_default=True,
              help="Sessions kept; a new one evicts the least recently used idle one.")
@click.option("--session-ttl", type=click.FloatRange(min=0, min_open=True), default=3600.0, show_default=True,
              help="Seconds a session may sit idle before it expires.")
@click.option("--api-key", default=None, help=f"Require `Authorization: Bearer KEY` on /v1 (or set {API_KEY_ENV}).")
@click.option("--model-name", default=None, help="The model's name in the API. [default: MODEL's file name]")
@click.option("--max-queue", type=click.IntRange(min=0), default=None,
              help="Requests waiting for a row before new ones get 429. [default: 4 x --max-batch]")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Longest prompt accepted (longer: 400).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Largest max_tokens a request may ask for (larger: 400).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True,
              help="Largest request body (larger: 413); restoring a session takes its state's size.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
              help="Prompt tokens fed per step between decode steps. [default: the model's max_segment]")
@click.option("--lazy", is_flag=True,
              help="Adaptive-softmax models exported with their head and tail graphs: each step computes the head, "
                   "and a tail only for the rows whose sampler needs it (TxlRuntime.generate's path and tokens; "
                   "log-probs from the parts, which may differ from the full graph's in the last bit). With "
                   "--triton: each step asks the servers for the head, and for a tail only when the decision "
                   "needs it (the Python backend runs only those graphs); the same tokens as without it. A model "
                   "without an adaptive softmax decodes the full distribution, as without the flag.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, seconds running streams get to finish.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "executorch", "torch", "torch-fast"]),
              help="[default: by file type: .onnx -> onnxruntime, .engine -> tensorrt, .pte -> executorch, "
                   "checkpoint -> torch]")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt).")
@click.option("--triton", "triton_urls", default=None, metavar="URL[,URL...]",
              help="Serve through these Triton servers (grpc://HOST:PORT or http://HOST:PORT) instead of a local "
                   "MODEL; sessions stay on one server by rendezvous hashing.")
@click.option("--triton-model", default="txl", show_default=True, help="The model's name in the Triton repository.")
@click.option("--vocab", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --triton: the vocabulary file when the servers' model config does not carry it.")
@tokenizer_option("For this server only: prompts are read and completions written with it; the model file is "
                  "unchanged.")
def serve(model, host, port, threads, max_batch, max_sessions, session_ttl, api_key, model_name, max_queue,
          max_prompt_tokens, max_tokens, max_body_bytes, prefill_chunk, lazy, drain_timeout, backend, providers,
          triton_urls, triton_model, vocab, tokenizer):
    """Serve MODEL (an .onnx, an .engine, an ExecuTorch .pte, a checkpoint or a hub reference
    hf://OWNER/NAME[@REVISION], fetched into the HuggingFace hub cache first) over HTTP with OpenAI's completions
    API.

    \b
    POST /v1/completions   prompt (text or token ids), stream, logprobs, stop, the sampling parameters
                           (ban_unk: true keeps <unk> out of the text), echo (the prompt back first, each
                           token scored with logprobs; max_tokens 0 only scores it), and session_id to
                           continue a session's memory
    POST /v1/sessions      create a session; GET/DELETE /v1/sessions/ID; POST /v1/sessions/ID/park returns
                           its memory's bytes, POST /v1/sessions/ID/restore takes them back
    GET  /v1/models, /health (200 once the model is loaded), /metrics (Prometheus)

    A session keeps the model's memory between requests, so continuing it costs only the new tokens. The log
    says how much memory each session holds. SIGTERM drains: no new requests, running streams finish (at most
    --drain-timeout seconds), exit 0. If the engine stops on an internal error, every request gets an answer,
    /health answers 503 and the process exits 1, for a supervisor to restart it.

    \b
    Example:
      txl-deploy serve model.onnx --port 8000 --threads 4
      curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"prompt": "And God said", "max_tokens": 40, "temperature": 0}'
    """
    # The server needs the serve extra (FastAPI, uvicorn, sse-starlette, prometheus-client), which a base install
    # lacks: imported here so that `txl-deploy --help` and every other command work without it.
    try:
        from txl_deploy.serving.http import app as http_app  # the serve extra
        from txl_deploy.serving.http import server as http_server  # the serve extra
        from txl_deploy.serving.http.fleet import FleetEngine  # the serve extra
        from txl_deploy.serving.http.scheduler import Scheduler  # the serve extra
    except ImportError as e:
        raise InputError(f"txl-deploy serve needs the serve extra: {install_hint('serve')} ({e})") from None
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    max_queue = 4 * max_batch if max_queue is None else max_queue
    options = dict(max_batch=max_batch, max_sessions=max_sessions, session_ttl=session_ttl, max_queue=max_queue)
    if triton_urls:
        if model is not None:
            raise InputError("give either MODEL or --triton, not both")
        urls = [u.strip() for u in triton_urls.split(",") if u.strip()]
        def load():
            engine = FleetEngine.connect(urls, model=triton_model, vocab=vocab, lazy=lazy, **options)
            # the engine and its client both read and write text: one vocabulary for both
            engine.vocab = engine.client.vocab = with_tokenizer(engine.vocab, tokenizer)
            return engine
        name = model_name or triton_model
    else:
        if model is None:
            raise InputError("give a MODEL to serve (or --triton URL to serve through Triton servers)")
        name = model_name or (model.name if isinstance(model, HubReference) else
                              Path(model).name.removesuffix(".onnx").removesuffix(".engine").removesuffix(".pte"))
        model = local_model(model)  # fetched before the server starts, with its progress on the terminal
        def load():  # Scheduler.load, with the runtime's tokenizer set before the engine takes its vocabulary
            runtime = TxlRuntime.load(model, backend=backend, threads=threads,
                                      providers=providers.split(",") if providers else None)
            engine = Scheduler(use_tokenizer(runtime, tokenizer), prefill_chunk=prefill_chunk, lazy=lazy, **options)
            engine.describe()
            return engine
    settings = http_app.ServeSettings(model_name=name, api_key=api_key, max_prompt_tokens=max_prompt_tokens,
                                      max_tokens=max_tokens, max_body_bytes=max_body_bytes,
                                      drain_timeout=drain_timeout)
    click.echo(f"serving {name!r} on http://{host}:{port} (loading the model; /health says when it is ready)",
               err=True)
    http_server.serve(load, settings, host=host, port=port)
    click.echo("stopped", err=True)


COMMANDS = [serve]
