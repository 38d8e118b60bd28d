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


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


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
def info(path, config, preset, vocab, vocab_kind, as_json):
    """Describe a checkpoint: source format, config, parameter count, vocabulary size and the recurrent memory
    one stream needs (hidden states as the paper caches them, and the key/value cache the exported graphs use)."""
    from ..checkpoints import load_model

    loaded = load_model(path, config=config, vocab=vocab, vocab_kind=vocab_kind, preset=preset)
    d = describe(loaded, loaded.build())
    if as_json:
        click.echo(json.dumps(d, indent=2, sort_keys=True))
        return
    cfg = loaded.config
    click.echo(f"path:        {d['path']}")
    click.echo(f"format:      {d['format']}")
    click.echo(f"parameters:  {d['parameters']:,}")
    if loaded.vocab is not None:
        click.echo(f"vocabulary:  {d['vocab_size']:,} symbols ({d['vocab_kind']}, from {d['vocab_source']})")
    else:
        click.echo("vocabulary:  none (pass --vocab FILE, or put vocab.txt / vocab.json beside the checkpoint)")
    mem = d["memory_bytes_per_stream"]
    click.echo(f"memory per stream (mem_len={cfg.mem_len}): hidden states {_size(mem['fp32']['hidden'])} fp32 / "
               f"{_size(mem['fp16']['hidden'])} fp16; key/value cache {_size(mem['fp32']['kv_cache'])} fp32 / "
               f"{_size(mem['fp16']['kv_cache'])} fp16")
    click.echo("config:")
    for key, value in d["config"].items():
        click.echo(f"  {key}: {value}")
    for key, source in d.get("config_sources", {}).items():
        click.echo(f"source of {key}: {source}")
    for note in d["notes"]:
        click.echo(f"note: {note}")


COMMANDS = [convert, info]
