"""`txl-deploy eval`: streaming evaluation of a text (bits per character or perplexity), as the paper evaluates."""

from __future__ import annotations

import json
from pathlib import Path

import click

from txl_deploy.cli.options import ModelReference, local_model, threads_option, use_tokenizer
from txl_deploy.errors import InputError
from txl_deploy.files import atomic_path
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.evaluation import evaluate_text
from txl_deploy.vocab import TOKENIZERS

TEXT_HELP = ("The text to evaluate on (e.g. a held-out split), read as the original preprocessing of the model's "
             "corpus read its test split: UTF-8 text for word and character models; for a byte-level (enwik8) model "
             "the file's raw bytes, with newlines dropped (the model never sees or predicts one), as the paper "
             "counts them; for text8, leading and trailing whitespace stripped.")


EVAL_TOKENIZER_HELP = ("How a word model reads --text. [default] whitespace: a pre-tokenized corpus file, as the "
                       "original data pipeline read WikiText-103's and One Billion Word's test files (the words "
                       "between spaces, <eos> at each line end; for an lm1b vocabulary <S> around each line): what "
                       "the paper's perplexities count. wikitext or lm1b: raw text, tokenized with that tokenizer "
                       "(HuggingFace TransfoXLTokenizer's Moses pipeline for WikiText-103; the One Billion Word "
                       "benchmark's Moses tokenization).")


@click.command("eval")
@click.argument("model", type=ModelReference(click.Path(exists=True)))
@click.option("--text", "text_file", required=True, type=click.Path(exists=True, dir_okay=False), help=TEXT_HELP)
@click.option("--tgt-len", type=click.IntRange(min=1), help="Segment length [default: the model's tgt_len].")
@click.option("--mem-len", type=click.IntRange(min=1), help="Memory length (checkpoints; an .onnx has its own).")
@click.option("--clamp-len", type=int, help="Clamp relative distances (checkpoints; <= 0: no clamping).")
@click.option("--same-length/--no-same-length", default=None, help="Every query sees the same number of keys "
              "(checkpoints).")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "executorch", "torch", "torch-fast"]),
              help="[default: by file type]")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt).")
@click.option("--zero-memory", is_flag=True, help="Start from mem_len zero vectors that are attended to, as the "
              "original TensorFlow evaluation (and HuggingFace) do, instead of the paper's empty memory.")
@click.option("--tokenizer", type=click.Choice(list(TOKENIZERS)), default=None, help=EVAL_TOKENIZER_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the result as JSON.")
@threads_option
def eval_cmd(model, text_file, tgt_len, mem_len, clamp_len, same_length, backend, providers, zero_memory, tokenizer,
             json_out, threads):
    """Evaluate MODEL on a text, reading it once left to right in segments of TGT_LEN tokens with the memory
    threaded between them (the paper's evaluation). Prints perplexity for word models and bits per character for
    character models; what is counted:

    \b
    - bytes (enwik8): bits per byte, the paper's bpc: the model's bits over the text's UTF-8 bytes other than
      newlines (the original preprocessing drops them, so they are neither predicted nor counted), per byte
      predicted (all but the first). To reproduce the paper, give the raw last 5,000,000 bytes of enwik8.
    - text8: bits per character over the stripped text, spaces included (the raw last 5,000,000 characters of
      text8 reproduce the paper's test split).
    - char: bits per character, every character (newlines included) after the first.
    - word: perplexity over the words and <eos> line ends after the first (--tokenizer says how the words are
      found).
    - events (music): perplexity over the events after the first, the text read one event a line.

    The JSON result says the same in `counting`, with the counts in `input`.

    MODEL may be a HuggingFace hub reference, hf://OWNER/NAME[@REVISION] (fetched into the hub cache, or found
    there offline, and run as a checkpoint).
    """
    model = local_model(model)
    data = Path(text_file).read_bytes()
    with TxlRuntime.load(model, backend=backend, providers=providers.split(",") if providers else None,
                         mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, threads=threads) as rt:
        tgt_len = tgt_len or rt.config.tgt_len
        raw = tokenizer not in (None, "whitespace")  # whitespace is the pre-tokenized reading, line ends included
        if raw:
            use_tokenizer(rt, tokenizer)
        try:
            result = evaluate_text(rt, data, tgt_len, zero_memory=zero_memory, raw=raw)
        except InputError as e:
            raise InputError(f"{text_file}: {e}") from None
        result.update(model=str(model), backend=rt.backend.name, tgt_len=tgt_len, mem_len=rt.mem_len,
                      clamp_len=rt.config.clamp_len, same_length=rt.config.same_length, text=str(text_file),
                      first_memory="zeros" if zero_memory else "empty")
    rows = [("model", model), ("backend", result["backend"]), ("text", text_file),
            ("tokens scored", f"{result['n_tokens']:,}"),
            ("tgt_len / mem_len / clamp_len", f"{tgt_len} / {result['mem_len']} / {result['clamp_len']}"),
            ("same_length", result["same_length"]), ("loss (nats/token)", f"{result['loss']:.4f}")]
    if result["unit"] == "ppl":
        rows.append(("perplexity", f"{result['perplexity']:.2f}"))
    elif result["counted"] == "bytes":
        rows.append(("bits per byte (bpc)", f"{result['bits_per_token']:.4f}"))
    else:
        rows.append(("bits per character", f"{result['bits_per_token']:.4f}"))
    rows.append(("time", f"{result['seconds']:.1f} s ({result['tokens_per_second']:,.0f} tokens/s)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")
    click.echo(f"counted: {result['counting']}")
    if json_out:
        with atomic_path(json_out, force=True) as tmp:
            tmp.write_text(json.dumps(result, indent=2) + "\n")


COMMANDS = [eval_cmd]
