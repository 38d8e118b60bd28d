"""`txl-deploy generate`: stream text from an exported graph, an engine or a checkpoint."""

from __future__ import annotations

import sys

import click

from txl_deploy.cli.options import (
    ModelReference,
    local_model,
    sampling_options,
    threads_option,
    tokenizer_option,
    use_tokenizer,
)
from txl_deploy.errors import InputError
from txl_deploy.music.grammar import GRAMMARS
from txl_deploy.runtimes import TxlRuntime


@click.command("generate")
@click.argument("model", type=ModelReference(click.Path(exists=True)))
@click.option("--prompt", required=True, help="Text to start from. For a byte-level (enwik8) model it is read as "
              "UTF-8 with newlines dropped, as the model was trained; for text8, lowercase a-z and spaces.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=200, show_default=True)
@sampling_options(temperature=1.0)
@click.option("--grammar", type=click.Choice(sorted(GRAMMARS)), default=None,
              help="A music model: sample only the events this representation's grammar allows next, so its MIDI "
                   "writer places every one (valid music by construction).")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "executorch", "torch", "torch-fast"]),
              help="[default: by file type: .onnx -> onnxruntime, .engine -> tensorrt, .pte -> executorch, "
                   "checkpoint -> torch]")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt).")
@tokenizer_option("For this run only.")
@threads_option
def generate_cmd(model, prompt, max_new_tokens, sampling, grammar, backend, providers, tokenizer, threads):
    """Stream text generated from MODEL (an .onnx, an .engine, an ExecuTorch .pte or a checkpoint) after PROMPT.

    The text is printed as it is generated, decoded incrementally: a character that a byte-level model spells over
    several tokens appears once complete, and bytes that are not UTF-8 print as U+FFFD. --no-unk keeps `<unk>` out
    of the text. The sampling options are those of the HTTP server (`txl-deploy serve`) and of
    `TxlRuntime.generate`.

    MODEL may be a HuggingFace hub reference, hf://OWNER/NAME[@REVISION], run as a checkpoint by PyTorch after it
    is fetched into the hub cache (or found there offline); exporting it first runs faster."""
    model = local_model(model)
    with TxlRuntime.load(model, backend=backend, providers=providers.split(",") if providers else None,
                         threads=threads) as rt:
        use_tokenizer(rt, tokenizer)
        if rt.vocab is None:
            raise InputError(f"{model}: has no vocabulary, so it cannot read a text prompt")
        # checked here, before the prompt is echoed
        pieces = rt.generate_text(prompt, max_new_tokens, grammar=grammar, **sampling)
        click.echo(prompt, nl=False)
        for piece in pieces:  # decoded incrementally: a character over several byte tokens prints once whole
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()


COMMANDS = [generate_cmd]
