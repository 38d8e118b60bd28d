"""`txl-deploy score`: the log-probability of each text of a file, for rescoring n-best lists at batch speed."""

from __future__ import annotations

import json
import time

import click

from txl_deploy.cli.options import ModelReference, local_model, threads_option, tokenizer_option, use_tokenizer
from txl_deploy.files import atomic_path, check_writable
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.score_input import FORMATS, read_input
from txl_deploy.runtimes.scoring import BATCH_BUDGET_BYTES, score_lines

FORMAT_HELP = ("text: one text a line. jsonl: one JSON object a line, {\"text\": ..., \"context\": ..., \"group\": "
               "..., \"id\": ...} (all but text optional; id is copied to the output). [default: auto: jsonl for a "
               ".jsonl or .json file or one whose first line starts with '{', else text]")


@click.command("score")
@click.argument("model", type=ModelReference(click.Path(exists=True)))
@click.argument("input_file", metavar="INPUT", type=click.File("rb"))
@click.option("-o", "--output", default="-", show_default=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Where the JSON Lines go ('-': stdout). A file is written whole at the end, atomically.")
@click.option("--force", is_flag=True, help="Overwrite the output file if it exists.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", help=FORMAT_HELP)
@click.option("--per-token", is_flag=True, help="Also write each text's tokens, their ids and their log-probs.")
@click.option("--line-end", is_flag=True, help="Score each text as a closed line: its line end (<eos>; One Billion "
              "Word: <S>) is predicted and counted too, as sentence rescoring usually counts the sentence end.")
@click.option("--no-start", "no_start", is_flag=True, help="Put nothing before each context (or a text without "
              "one): no line end (<eos>, <S>) as the start of the line. A text without context then has its first "
              "token neither predicted nor counted.")
@click.option("--batch-budget", type=click.IntRange(min=1), default=BATCH_BUDGET_BYTES >> 20, show_default=True,
              metavar="MiB", help="Memory one batch of rows may take: each row's model memory, its log-prob "
              "chunk and its share of the model's temporaries. At least one row runs.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "executorch", "torch", "torch-fast"]),
              help="[default: by file type]")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt).")
@tokenizer_option("For this run only; the model's file is unchanged.")
@threads_option
def score_cmd(model, input_file, output, force, fmt, per_token, line_end, no_start, batch_budget, backend, providers,
              tokenizer, threads):
    """Score each text of INPUT with MODEL: writes one JSON line per input line, in order, with the text's total
    log-probability (natural log), the tokens counted and the perplexity, e.g.

    \b
      {"line": 1, "log_prob": -23.61, "n_tokens": 9, "perplexity": 13.79}

    INPUT ('-': stdin) holds one text a line, or JSON Lines giving each text a context and a group. A context is
    read before its text and not counted. Texts with the same group (or, without one, the same context) are
    scored from one reading of the context, copied into a row per text: an utterance's n-best hypotheses
    cost one reading of its context, and run as one batch.

    What is counted: every token of the text, given the context and, for word models, after the vocabulary's line
    end as the start of the line (as each line of WikiText-103 follows the previous one's <eos>); a model without
    one (characters, bytes) does not predict the text's first token, nor counts it. Word models split the text with
    their tokenizer (--tokenizer).

    A bad line (not UTF-8, malformed JSON, an empty text, a symbol the vocabulary lacks and no <unk>, a line over
    1 MiB) gets {"line": N, "error": "..."} and the others are scored all the same.
    """
    if output != "-":
        check_writable(output, force)  # before any work
    lines = read_input(input_file, fmt, getattr(input_file, "name", "") or "")
    started = time.perf_counter()
    with TxlRuntime.load(local_model(model), backend=backend, threads=threads,
                         providers=providers.split(",") if providers else None) as rt:
        use_tokenizer(rt, tokenizer)
        records = score_lines(rt, lines, per_token=per_token, batch_budget=batch_budget << 20, start=not no_start,
                              line_end=line_end, progress=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if output == "-":
        click.echo(text, nl=False)
    else:
        with atomic_path(output, force=force) as tmp:
            tmp.write_text(text, encoding="utf-8")
    bad = sum("error" in r for r in records)
    tokens = sum(r.get("n_tokens", 0) for r in records)
    click.echo(f"scored {len(records) - bad:,} texts ({tokens:,} tokens) in {time.perf_counter() - started:.1f} s"
               + (f"; {bad:,} lines with errors" if bad else ""), err=True)

COMMANDS = [score_cmd]
