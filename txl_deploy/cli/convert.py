"""`txl-deploy convert`: read any supported checkpoint, write ours (config.json, model.safetensors, vocab.json)."""

from __future__ import annotations

from pathlib import Path

import click

from txl_deploy.checkpoints import load_model, save_checkpoint
from txl_deploy.checkpoints.tensorflow.convert import TF_LAYER_NORM_EPSILON, TF_SAME_LENGTH_EXTRA
from txl_deploy.cli.options import ModelReference, local_model, tokenizer_option, vocab_options
from txl_deploy.files import check_writable
from txl_deploy.progress import progress_bar


@click.command()
@click.argument("src", type=ModelReference(click.Path(path_type=Path)))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Folder to write (config.json, model.safetensors, vocab.json).")
@vocab_options
@tokenizer_option("Stored with the vocabulary in the output, so every later command reads text this way.")
@click.option("--no-vocab", is_flag=True, help="Convert the weights alone when no vocabulary is available "
                                                "(commands that read or write text will then refuse the model).")
@click.option("--tf-semantics", is_flag=True,
              help="Compute as the original TensorFlow code does: a same_length window of mem_len + 1 keys and "
                   "layer-norm epsilon 1e-12 (for HuggingFace's transfo-xl-wt103, which was converted from the "
                   "TensorFlow checkpoint; TensorFlow checkpoints get these settings anyway).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
def convert(src, out, config, preset, vocab, vocab_kind, representation, tokenizer, no_vocab, tf_semantics, force):
    """Convert a checkpoint (original CMU model.pt, a state_dict + config, a HuggingFace transfo-xl folder, an
    NVIDIA DeepLearningExamples checkpoint, an original TensorFlow model.ckpt-N or its published folder with model/
    and data/, a REMI (Pop Music Transformer) checkpoint folder, Compound Word Transformer's remi-xl ep_N.pth.tar, or ours) into a txl-deploy folder, checking every tensor's shape. The output is written
    atomically.

    SRC may be a HuggingFace hub reference, hf://OWNER/NAME[@REVISION]: it is fetched into the hub cache (or read
    from it offline) and read as a HuggingFace folder (needs the hub extra; from the checkout:
    pip install -e '.[hub]')."""
    check_writable(out, force)  # fail before the (possibly long) load
    src = local_model(src)
    with progress_bar(total=3, desc="convert", unit="step") as bar:
        bar.set_postfix_str("reading")
        loaded = load_model(src, config=config, vocab=vocab, vocab_kind=vocab_kind, preset=preset,
                            tokenizer=tokenizer, representation=representation)
        if tf_semantics:
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


COMMANDS = [convert]
