"""`txl-deploy serve-client`: generate text through a Triton server (or several) running a txl-deploy model."""

from __future__ import annotations

import sys

import click

from txl_deploy.cli.options import sampling_options, tokenizer_option, with_tokenizer
from txl_deploy.errors import InputError
from txl_deploy.serving.triton.client import TxlTritonClient


@click.command("serve-client")
@click.argument("url")
@click.option("--prompt", required=True, help="Text that starts the conversation.")
@click.option("--model", default="txl", show_default=True, help="Model name in the Triton repository.")
@click.option("--max-new-tokens", type=int, default=50, show_default=True, help="Tokens to generate.")
@sampling_options(temperature=0.0)
@click.option("--vocab", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Vocabulary file (REPO/MODEL/vocab.json) when the server's model config does not carry it.")
@tokenizer_option("For this client only: the server's model is unchanged.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for each request.")
def serve_client(url, prompt, model, max_new_tokens, sampling, vocab, tokenizer, timeout):
    """Generate text from a Triton server at URL (http://HOST:PORT or grpc://HOST:PORT), streaming tokens as
    they arrive. The conversation is one Triton sequence, ended when generation stops. The server returns
    log-probs; this client samples them with the sampler every txl-deploy path uses (the options of `generate`).
    The text continues PROMPT, decoded as `generate` prints it; the prompt itself is not printed again."""
    # lazy: an adaptive-softmax model sends each step's head and only the tails the sampler asks for
    client = TxlTritonClient(url, model=model, vocab=vocab, timeout=timeout, lazy=True)
    try:
        if client.vocab is None:
            raise InputError(f"model {model!r} publishes no vocabulary: pass --vocab REPO/{model}/vocab.json")
        client.vocab = with_tokenizer(client.vocab, tokenizer)  # the prompt encoded and the text decoded with it
        for piece in client.generate_text(prompt, max_new_tokens=max_new_tokens, **sampling):
            sys.stdout.write(piece)  # a character over several byte tokens prints once complete
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        client.close()


COMMANDS = [serve_client]
