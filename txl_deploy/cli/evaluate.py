"""`txl-deploy eval`: streaming evaluation of a text (bits per character or perplexity), as the paper evaluates."""

from __future__ import annotations

import json

import click

from txl_deploy.cli.options import threads_option
from txl_deploy.errors import CheckpointError
from txl_deploy.files import atomic_path
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.evaluation import evaluate_text


@click.command("eval")
@click.argument("model", type=click.Path(exists=True))
@click.option("--text", "text_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="UTF-8 text to evaluate on (e.g. a held-out split).")
@click.option("--tgt-len", type=click.IntRange(min=1), help="Segment length [default: the model's tgt_len].")
@click.option("--mem-len", type=click.IntRange(min=1), help="Memory length (checkpoints; an .onnx has its own).")
@click.option("--clamp-len", type=int, help="Clamp relative distances (checkpoints; <= 0: no clamping).")
@click.option("--same-length/--no-same-length", default=None, help="Every query sees the same number of keys "
              "(checkpoints).")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "torch", "torch-fast"]),
              help="[default: by file type]")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt).")
@click.option("--zero-memory", is_flag=True, help="Start from mem_len zero vectors that are attended to, as the "
              "original TensorFlow evaluation (and HuggingFace) do, instead of the paper's empty memory.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the result as JSON.")
@threads_option
def eval_cmd(model, text_file, tgt_len, mem_len, clamp_len, same_length, backend, providers, zero_memory, json_out,
             threads):
    """Evaluate MODEL on a text, reading it once left to right in segments of TGT_LEN tokens with the memory
    threaded between them (the paper's evaluation). Prints bits per character for character models and
    perplexity for word models."""
    try:
        text = open(text_file, encoding="utf-8").read()
    except UnicodeDecodeError:
        raise CheckpointError(text_file, "not UTF-8 text") from None
    with TxlRuntime.load(model, backend=backend, providers=providers.split(",") if providers else None,
                         mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, threads=threads) as rt:
        tgt_len = tgt_len or rt.config.tgt_len
        result = evaluate_text(rt, text, tgt_len, zero_memory=zero_memory)
        result.update(model=str(model), backend=rt.backend.name, tgt_len=tgt_len, mem_len=rt.mem_len,
                      clamp_len=rt.config.clamp_len, same_length=rt.config.same_length, text=str(text_file),
                      first_memory="zeros" if zero_memory else "empty")
    rows = [("model", model), ("backend", result["backend"]), ("text", text_file),
            ("tokens scored", f"{result['n_tokens']:,}"),
            ("tgt_len / mem_len / clamp_len", f"{tgt_len} / {result['mem_len']} / {result['clamp_len']}"),
            ("same_length", result["same_length"]), ("loss (nats/token)", f"{result['loss']:.4f}")]
    if result["unit"] == "bpc":
        rows.append(("bits per character", f"{result['bits_per_token']:.4f}"))
    else:
        rows.append(("perplexity", f"{result['perplexity']:.2f}"))
    rows.append(("time", f"{result['seconds']:.1f} s ({result['tokens_per_second']:,.0f} tokens/s)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")
    if json_out:
        with atomic_path(json_out, force=True) as tmp:
            tmp.write_text(json.dumps(result, indent=2) + "\n")


COMMANDS = [eval_cmd]
