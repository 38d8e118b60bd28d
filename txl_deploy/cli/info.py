"""`txl-deploy info`: describe a checkpoint or an exported graph, and (--memory) the memory its jobs need."""

from __future__ import annotations

import json
from pathlib import Path

import click

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.describe import describe_checkpoint
from txl_deploy.cli.options import ModelReference, local_model, model_vocab, vocab_options
from txl_deploy.contract.describe import describe_onnx, describe_pte
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.parts import Parts
from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.exporters.onnx.ram import format_bytes as fb
from txl_deploy.exporters.onnx.ram import loaded_weight_bytes, ram_report
from txl_deploy.vocab import DESCRIPTIONS


@click.command()
@click.argument("path", type=ModelReference(click.Path(path_type=Path)))
@vocab_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--list-vocab", is_flag=True, help="List the vocabulary instead: each symbol's id and the symbol "
              "(quoted as Python writes it, so a space or a newline shows), one per line (--json: a list).")
@click.option("--memory", is_flag=True, help="Also estimate the memory an export and the ONNX Runtime runtime need, "
              "and the memory per stream of each precision, against what this machine has available now.")
@click.option("--mem-len", type=click.IntRange(min=1), help="--memory: the memory length to size for "
              "[default: the checkpoint's, or the graph's].")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="--memory: streams run together.")
@click.option("--max-segment", type=click.IntRange(min=1), default=512, show_default=True,
              help="--memory, for a checkpoint: the longest segment of the export (an .onnx file's own is used).")
def info(path, config, preset, vocab, vocab_kind, representation, as_json, list_vocab, memory, mem_len, batch,
         max_segment):
    """Describe a checkpoint, an exported .onnx or an ExecuTorch .pte (from its sidecar): source format (for a
    checkpoint, the family it comes from: txl-deploy, cmu, cmu-state-dict, huggingface, nvidia, tensorflow, remi,
    remi-xl), config, parameter count, vocabulary (size and
    kind: word, char, bytes for enwik8, text8, events for music, with its representation) and the
    recurrent memory one stream needs (hidden states as the paper caches them, and the key/value cache the exported
    graphs use); for a reduced-precision file, its stored check against fp32. --memory adds the expected peak
    memory of an export and of the runtime; --list-vocab lists the vocabulary instead.

    \b
    Example:
      txl-deploy info model.pt --memory --mem-len 1600
      txl-deploy info wt103.onnx --memory --batch 8
      txl-deploy info model.pte
      txl-deploy info model.onnx --list-vocab
      txl-deploy info hf://transfo-xl/transfo-xl-wt103
    """
    path = local_model(path)
    if list_vocab:
        _list_vocab(path, as_json, config=config, vocab=vocab, vocab_kind=vocab_kind, preset=preset,
                    representation=representation)
        return
    if path.suffix == ".onnx" and path.is_file():
        d, cfg, weight_bytes, max_segment, precision = describe_onnx(path)
    elif path.suffix == ".pte" and path.is_file():
        d, cfg, weight_bytes, max_segment, precision = describe_pte(path)
    else:
        loaded = load_model(path, config=config, vocab=vocab, vocab_kind=vocab_kind, preset=preset,
                            representation=representation)
        d = describe_checkpoint(loaded)
        cfg, weight_bytes, precision = loaded.config, loaded_weight_bytes(loaded), "fp32"
    if path.suffix == ".onnx" and path.is_file():
        d["softmax_parts"] = _softmax_parts(path)
    if memory:
        d["memory_estimate"] = ram_report(cfg, weight_bytes, mem_len or cfg.mem_len or 1, max_segment, batch,
                                          precision)
    if as_json:
        click.echo(json.dumps(d, indent=2, sort_keys=True, default=str))
        return
    click.echo(f"path:        {d['path']}")
    click.echo(f"format:      {d['format']}" + (f" ({d['family']})" if d.get("family") else ""))
    # the model's trained tensors, as a checkpoint counts them; not the tables an export precomputes
    click.echo(f"parameters:  {d['parameters']:,}" if d["parameters"] else
               "parameters:  not recorded in this file (exported by an older txl-deploy)")
    if d.get("precision_report"):
        try:
            lines = _precision_lines(d["precision_report"])
        except (AttributeError, KeyError, TypeError, ValueError):  # the file's metadata is not to be trusted
            lines = ["precision:   its stored report against fp32 is unreadable"]
        for line in lines:
            click.echo(line)
    if d["vocab_size"] is not None:
        # a word vocabulary read by a Moses tokenizer is not split on whitespace, as the kind's description says
        moses = d.get("vocab_tokenizer") not in (None, "whitespace")
        what = "words as its tokenizer splits and joins them" if moses else DESCRIPTIONS[d["vocab_kind"]]
        click.echo(f"vocabulary:  {d['vocab_size']:,} symbols, kind {d['vocab_kind']}: {what}")
        click.echo(f"  from:      {d['vocab_source']}" + (f": {d['vocab_format']}" if d.get("vocab_format") else ""))
        if d.get("vocab_tokenizer"):
            click.echo(f"  tokenizer: {d['vocab_tokenizer']}")
        if d.get("vocab_kind") == "events":
            shown = d.get("vocab_representation") or "none (not a representation txl-deploy writes as MIDI)"
            click.echo(f"  representation: {shown}")
    else:
        click.echo("vocabulary:  none (pass --vocab FILE, or put vocab.json / vocab.txt / vocab.pkl / vocab.bin / "
                   "cache.pt / dictionary.pkl beside the checkpoint)")

    mem = d["memory_bytes_per_stream"]
    click.echo(f"memory per stream (mem_len={mem['mem_len']}): hidden states {fb(mem['fp32']['hidden'])} fp32 / "
               f"{fb(mem['fp16']['hidden'])} fp16; key/value cache {fb(mem['fp32']['kv_cache'])} fp32 / "
               f"{fb(mem['fp16']['kv_cache'])} fp16")
    parts = d.get("softmax_parts")
    if parts:
        click.echo(f"softmax parts: {parts['head']} (body + head: shortlist {parts['shortlist']} and "
                   f"{len(parts['tails'])} cluster columns), {parts['status']}")
        for i, t in enumerate(parts["tails"], start=1):
            click.echo(f"  tail {i}:    {t['file']}, tokens [{t['lo']}, {t['hi']}), head column {t['head_column']}")
    click.echo("config:")
    for key, value in d["config"].items():
        click.echo(f"  {key}: {value}")
    for key, source in d.get("config_sources", {}).items():
        click.echo(f"source of {key}: {source}")
    for note in d["notes"]:
        click.echo(f"note: {note}")
    if memory:
        _print_memory(d["memory_estimate"])


def _list_vocab(path, as_json: bool, **how) -> None:
    table = model_vocab(path, **how)
    if table is None:
        raise InputError(f"{path}: has no vocabulary (pass --vocab FILE for a checkpoint without one beside it)")
    if as_json:
        click.echo(json.dumps(list(table.symbols), ensure_ascii=False))
        return
    for i, symbol in enumerate(table.symbols):
        click.echo(f"{i}\t{symbol!r}")


def _precision_lines(report: dict) -> list[str]:
    """The stored check of a reduced graph against its fp32 graph: how it was made, how far it is."""
    method, stream, accuracy = report.get("method") or {}, report.get("stream") or {}, report.get("accuracy")
    how = method.get("format", "")
    if method.get("block_size"):
        how += f", {method.get('bits', 4)}-bit blocks of {method['block_size']}"
    lines = [f"precision:   {report.get('precision')} ({how})" if how else f"precision:   {report.get('precision')}"]
    if stream:
        lines.append(f"  against fp32: KL divergence {stream['kl_divergence']:.3g} nats per position (tolerance "
                     f"{stream.get('tolerance', float('nan')):g}), top-1 agreement {stream['top1_agreement']:.4f} "
                     f"over {stream['tokens']} positions")
    if accuracy:
        name = accuracy["metric"].replace("_", " ")
        lines.append(f"  {name} on {accuracy['tokens']:,} tokens of {accuracy.get('data', 'the evaluation text')}: "
                     f"fp32 {accuracy['fp32']:.4f}, {report.get('precision')} {accuracy['reduced']:.4f} "
                     f"({100 * accuracy['relative_change']:+.2f}%)")
    return lines


def _softmax_parts(path) -> dict | None:
    """The adaptive softmax's head and tail graphs the model lists, and whether the files beside it are theirs."""
    info = read_onnx_info(path)
    parts = Parts.from_export(info.export, info.config, path)
    if parts is None:
        return None
    try:
        parts.files(path)
        status = "present and matching (lazy decoding available)"
    except CheckpointError as e:
        status = f"refused: {e}"
    layout = parts.layout
    return {"head": parts.head.file, "shortlist": layout.shortlist, "status": status,
            "tails": [{"file": t.file, "lo": lo, "hi": hi, "head_column": layout.head_column(i)}
                      for i, (t, (lo, hi)) in enumerate(zip(parts.tails, layout.bounds), start=1)]}


def _print_memory(m: dict) -> None:
    click.echo(f"memory (estimates, mem_len {m['mem_len']}, batch {m['batch']}, segments up to {m['max_segment']}):")
    click.echo(f"  weights        {fb(m['weight_bytes'])}")
    if m["export"]:
        v, n = m["export"]["verify"], m["export"]["no_verify"]
        phase = v["what"].split("(")[-1].rstrip(")")
        click.echo(f"  export         about {fb(v['bytes'])} with verification ({phase}), "
                   f"about {fb(n['bytes'])} with --no-verify")
    r = m["runtime"]
    parts = ", ".join(f"{k} {fb(b)}" for k, b in r["terms"].items())
    click.echo(f"  runtime        about {fb(r['bytes'])} on ONNX Runtime, {r['precision']} ({parts})")
    per = m["state_per_precision"]
    click.echo("  state          " + ", ".join(f"{p} {fb(b)}" for p, b in per.items())
               + f" (batch {m['batch']} at mem_len {m['mem_len']})")
    avail = m["available_bytes"]
    if avail is None:
        return
    click.echo(f"  available now  {fb(avail)}")
    if m["export"] and m["export"]["verify"]["bytes"] > avail:
        hint = (" --no-verify would fit" if m["export"]["no_verify"]["bytes"] <= avail else
                " even --no-verify would not")
        click.echo(f"warning: an export with verification needs more than the memory available now;{hint}", err=True)
    if r["bytes"] > avail:
        click.echo("warning: the runtime needs more than the memory available now", err=True)


COMMANDS = [info]
