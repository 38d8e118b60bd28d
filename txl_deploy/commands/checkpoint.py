"""`txl-deploy convert` and `txl-deploy info`: read any supported checkpoint, write ours / describe it."""

from __future__ import annotations

import json
from pathlib import Path

import click

VOCAB_HELP = ("Vocabulary file: our vocab.json, the original one-symbol-a-line vocab.txt, a character list "
              "(with --vocab-kind char), or a TensorFlow model's data/cache.pkl (read without running anything). "
              "Overrides a vocabulary found in or beside the checkpoint.")
CONFIG_HELP = ("JSON config for a bare state_dict: our TxlConfig fields or the original MemTransformerLM "
               "constructor arguments. Default: <name>.json or config.json beside the weights. For a TensorFlow "
               "checkpoint: its training flags under tf/train_gpu.py's names (n_layer, mem_len, same_length, ...).")
PRESET_HELP = ("Which of the paper's published models a TensorFlow checkpoint is: its evaluation settings (tgt_len, "
               "mem_len, clamp_len, same_length) become the defaults. Default: the one its shapes fit.")
KIND_HELP = "How to read a text --vocab / vocab.txt: word (one symbol a line) or char (a character list)."


def _vocab_options(f):
    f = click.option("--vocab-kind", type=click.Choice(["word", "char"]), default=None, help=KIND_HELP)(f)
    f = click.option("--vocab", "vocab", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help=VOCAB_HELP)(f)
    f = click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help=CONFIG_HELP)(f)
    f = click.option("--preset", type=click.Choice(["enwik8-large", "text8-large", "wt103-large", "lm1b-large"]),
                     default=None, help=PRESET_HELP)(f)
    return f


@click.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Folder to write (config.json, model.safetensors, vocab.json).")
@_vocab_options
@click.option("--no-vocab", is_flag=True, help="Convert the weights alone when no vocabulary is available "
                                                "(commands that read or write text will then refuse the model).")
@click.option("--tf-semantics", is_flag=True,
              help="Compute as the original TensorFlow code does: a same_length window of mem_len + 1 keys and "
                   "layer-norm epsilon 1e-12 (for HuggingFace's transfo-xl-wt103, which was converted from the "
                   "TensorFlow checkpoint; TensorFlow checkpoints get these settings anyway).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
def convert(src, out, config, preset, vocab, vocab_kind, no_vocab, tf_semantics, force):
    """Convert a checkpoint (original CMU model.pt, a state_dict + config, a HuggingFace transfo-xl folder, an
    NVIDIA DeepLearningExamples checkpoint, an original TensorFlow model.ckpt-N or its published folder with model/
    and data/, or ours) into a txl-deploy folder, checking every tensor's shape. The output is written
    atomically."""
    from tqdm import tqdm

    from ..checkpoints import load_model, save_checkpoint
    from ..files import check_writable

    check_writable(out, force)  # fail before the (possibly long) load
    with tqdm(total=3, desc="convert", unit="step", disable=None, leave=False) as bar:
        bar.set_postfix_str("reading")
        loaded = load_model(src, config=config, vocab=vocab, vocab_kind=vocab_kind, preset=preset)
        if tf_semantics:
            from ..checkpoints.tensorflow import TF_LAYER_NORM_EPSILON, TF_SAME_LENGTH_EXTRA

            loaded.config = loaded.config.replace(same_length_extra=TF_SAME_LENGTH_EXTRA,
                                                  layer_norm_epsilon=TF_LAYER_NORM_EPSILON)
            loaded.notes.append("converted with --tf-semantics: same_length window of mem_len + 1 keys and "
                                "layer-norm epsilon 1e-12, as the original TensorFlow code")
        if loaded.vocab is None and not no_vocab:
            loaded.require_vocab()
        bar.update()
        bar.set_postfix_str("checking shapes")
        model = loaded.build()
        bar.update()
        bar.set_postfix_str("writing")
        source = {"format": loaded.source_format, "path": str(src), "notes": loaded.notes}
        if getattr(loaded, "value_sources", None):
            source["config_sources"] = loaded.value_sources  # where each config value came from
        save_checkpoint(out, model, loaded.vocab, force=force, extra={"source": source})
        bar.update()
    n_params = sum(p.numel() for p in model.parameters())
    vocab_text = f"{len(loaded.vocab)} symbols" if loaded.vocab is not None else "no vocabulary"
    click.echo(f"wrote {out} ({loaded.source_format} -> txl-deploy, {n_params:,} parameters, {vocab_text})")


def describe(loaded, model) -> dict:
    cfg = loaded.config
    return {
        "path": loaded.path,
        "format": loaded.source_format,
        "config": cfg.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(loaded.vocab) if loaded.vocab is not None else None,
        "vocab_kind": loaded.vocab.kind if loaded.vocab is not None else None,
        "vocab_source": loaded.vocab_source,
        "memory_bytes_per_stream": {
            "mem_len": cfg.mem_len,
            "fp32": cfg.memory_bytes_per_stream(bytes_per_value=4),
            "fp16": cfg.memory_bytes_per_stream(bytes_per_value=2),
        },
        "notes": list(loaded.notes),
        **({"config_sources": loaded.value_sources} if getattr(loaded, "value_sources", None) else {}),
    }


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@_vocab_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--memory", is_flag=True, help="Also estimate the memory an export and the ONNX Runtime runtime need, "
              "and the memory per stream of each precision, against what this machine has available now.")
@click.option("--mem-len", type=click.IntRange(min=1), help="--memory: the memory length to size for "
              "[default: the checkpoint's, or the graph's].")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="--memory: streams run together.")
@click.option("--max-segment", type=click.IntRange(min=1), default=512, show_default=True,
              help="--memory, for a checkpoint: the longest segment of the export (an .onnx file's own is used).")
def info(path, config, preset, vocab, vocab_kind, as_json, memory, mem_len, batch, max_segment):
    """Describe a checkpoint or an exported .onnx: source format, config, parameter count, vocabulary size and the
    recurrent memory one stream needs (hidden states as the paper caches them, and the key/value cache the exported
    graphs use). --memory adds the expected peak memory of an export and of the runtime.

    \b
    Example:
      txl-deploy info model.pt --memory --mem-len 1600
      txl-deploy info wt103.onnx --memory --batch 8
    """
    if path.suffix == ".onnx" and path.is_file():
        d, cfg, weight_bytes, max_segment, precision = _describe_onnx(path)
    else:
        from ..checkpoints import load_model
        from ..memory import loaded_weight_bytes

        loaded = load_model(path, config=config, vocab=vocab, vocab_kind=vocab_kind, preset=preset)
        d = describe(loaded, loaded.build())
        cfg, weight_bytes, precision = loaded.config, loaded_weight_bytes(loaded), "fp32"
    if memory:
        d["memory_estimate"] = memory_estimate(cfg, weight_bytes, mem_len or cfg.mem_len or 1, max_segment,
                                               batch, precision)
    if as_json:
        click.echo(json.dumps(d, indent=2, sort_keys=True, default=str))
        return
    click.echo(f"path:        {d['path']}")
    click.echo(f"format:      {d['format']}")
    click.echo(f"parameters:  {d['parameters']:,}" if d["parameters"] else
               "parameters:  not known from the file (quantized weights)")
    if d["vocab_size"] is not None:
        click.echo(f"vocabulary:  {d['vocab_size']:,} symbols ({d['vocab_kind']}, from {d['vocab_source']})")
    else:
        click.echo("vocabulary:  none (pass --vocab FILE, or put vocab.txt / vocab.json beside the checkpoint)")
    from ..memory import format_bytes as fb

    mem = d["memory_bytes_per_stream"]
    click.echo(f"memory per stream (mem_len={mem['mem_len']}): hidden states {fb(mem['fp32']['hidden'])} fp32 / "
               f"{fb(mem['fp16']['hidden'])} fp16; key/value cache {fb(mem['fp32']['kv_cache'])} fp32 / "
               f"{fb(mem['fp16']['kv_cache'])} fp16")
    click.echo("config:")
    for key, value in d["config"].items():
        click.echo(f"  {key}: {value}")
    for key, source in d.get("config_sources", {}).items():
        click.echo(f"source of {key}: {source}")
    for note in d["notes"]:
        click.echo(f"note: {note}")
    if memory:
        _print_memory(d["memory_estimate"])


def _describe_onnx(path):
    from ..memory import weight_file_bytes
    from ..metadata import read_onnx_info

    info = read_onnx_info(path)
    cfg = info.config
    weight_bytes = weight_file_bytes(path)
    d = {
        "path": path, "format": f"onnx ({info.precision}, {info.export.get('state', 'incremental')} state)",
        "config": cfg.to_dict(), "parameters": _parameters(cfg, weight_bytes, info.precision),
        "vocab_size": len(info.vocab) if info.vocab is not None else None,
        "vocab_kind": info.vocab.kind if info.vocab is not None else None, "vocab_source": "the file's metadata",
        "memory_bytes_per_stream": {"mem_len": info.mem_len,
                                    "fp32": cfg.memory_bytes_per_stream(info.mem_len, bytes_per_value=4),
                                    "fp16": cfg.memory_bytes_per_stream(info.mem_len, bytes_per_value=2)},
        "notes": [], "weight_bytes": weight_bytes, "max_segment": info.max_segment,
    }
    return d, cfg.replace(mem_len=info.mem_len), weight_bytes, info.max_segment, info.precision


def _parameters(cfg, weight_bytes: int, precision: str) -> int:
    """Parameters of an exported graph: its file bytes over bytes per weight (fp32 4, fp16 2; approximate)."""
    return int(weight_bytes // (2 if precision == "fp16" else 4)) if precision in ("fp32", "fp16") else 0


def memory_estimate(cfg, weight_bytes: int, mem_len: int, max_segment: int, batch: int, precision: str) -> dict:
    from ..memory import STATE_BYTES, available_bytes, export_peaks, runtime_peak, state_bytes

    fp32_weights = weight_bytes if precision == "fp32" else None
    export = export_peaks(cfg, fp32_weights, mem_len, max_segment) if fp32_weights else None
    runtime = runtime_peak(cfg, weight_bytes, mem_len, max_segment, batch, precision)
    return {
        "mem_len": mem_len, "batch": batch, "max_segment": max_segment, "weight_bytes": weight_bytes,
        "export": {k: {"bytes": e.total, "what": e.what, "terms": e.terms} for k, e in export.items()} if export
        else None,
        "runtime": {"bytes": runtime.total, "terms": runtime.terms, "precision": precision},
        "state_per_precision": {p: state_bytes(cfg, mem_len, batch, p) for p in STATE_BYTES},
        "available_bytes": available_bytes(),
    }


def _print_memory(m: dict) -> None:
    from ..memory import format_bytes as fb

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


COMMANDS = [convert, info]
