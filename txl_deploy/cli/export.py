"""`txl-deploy export`: any supported checkpoint to a self-describing, verified ONNX graph or ExecuTorch program."""

from __future__ import annotations

import click

from txl_deploy.checkpoints.hub import HubReference
from txl_deploy.cli.options import ModelReference, local_model, threads_option, tokenizer_option, vocab_options
from txl_deploy.exporters.export import export_checkpoint
from txl_deploy.exporters.precision.int4 import INT4_DEFAULT_BLOCK

STATE_HELP = ("memory layout of the graph: 'incremental' outputs only this segment's keys/values (the runtime "
              "updates its ring buffer in place; fastest), 'full' outputs the whole next state (Triton implicit "
              "state, ping-pong GPU buffers)")


@click.command("export")
@click.argument("checkpoint", type=ModelReference(click.Path(exists=True)))
@click.option("--onnx", "to_onnx", is_flag=True, default=True, help="Export to ONNX (the default target).")
@click.option("--executorch", is_flag=True,
              help="Export an ExecuTorch program for phones instead: NAME.pte (delegated to XNNPACK, batch 1 to 64, "
                   "segments up to --max-segment) and its sidecar NAME.pte.json (config, vocabulary, export "
                   "settings; keep the two together). --precision fp32, int8 (8da8w) or int4 (8da4w). Needs the "
                   "executorch extra.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Output file [default: CHECKPOINT name + .onnx "
              "(.pte with --executorch); a hub reference: the repository's name].")
@click.option("--mem-len", type=click.IntRange(min=1), help="Memory length of the graph [default: the checkpoint's]. "
              "May exceed the training memory.")
@click.option("--clamp-len", type=int, help="Clamp relative distances at this value (<= 0: no clamping) "
              "[default: the checkpoint's]. Built into the graph and recorded in its metadata.")
@click.option("--same-length/--no-same-length", default=None, help="Let every query see the same number of keys "
              "(the last mem_len) [default: the checkpoint's]. Built into the graph and recorded in its metadata.")
@click.option("--opset", type=click.IntRange(17, 20), default=18, show_default=True,
              help="ONNX opset (17 to 20: what the TensorRT 10.x and 11.x parsers read).")
@click.option("--state", type=click.Choice(["incremental", "full"]), default="incremental", show_default=True,
              help=STATE_HELP)
@click.option("--max-segment", type=click.IntRange(min=1), default=512, show_default=True,
              help="Longest segment one call of the graph takes (longer inputs are fed in pieces).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8", "int8-dynamic", "int4"]), default="fp32",
              show_default=True, help="Numeric precision of the graph (reduced precision is verified against fp32). "
              "int4: 4-bit weights (ONNX Runtime MatMulNBits, CPU and browser; not TensorRT). With --executorch: "
              "fp32, int8 (int8 weights per channel) or int4 (int4 weights in groups of 32), both with int8 "
              "activations quantized at run time, gated at bits per character within 2% of fp32 on --eval-text.")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128", "256"]),
              help="--precision int4: weights per block sharing one scale (larger: fewer scales, coarser). "
                   f"[default: {INT4_DEFAULT_BLOCK}]")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False),
              help="Calibration data for --precision int8: text (tokenized with the model's vocabulary) or a .npy of "
                   "token ids.")
@click.option("--eval-text", type=click.Path(exists=True, dir_okay=False),
              help="Held-out text for measuring the accuracy change of reduced precision [default: calibration text].")
@vocab_options
@tokenizer_option("Stored with the vocabulary in the output, so every later command reads text this way.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check ONNX Runtime (ExecuTorch's runtime for --executorch) against the PyTorch reference on "
                   "multi-segment streams; fail on a mismatch.")
@click.option("--ort-format", is_flag=True,
              help="Also write the ONNX Runtime format beside the graph, for ONNX Runtime's minimal builds (phones): "
                   "NAME.ort and NAME.required_operators.config (the operators a custom build must include). Any "
                   "precision; written only if its log-probs equal the .onnx's bit for bit on a multi-segment "
                   "stream (checked even with --no-verify). ONNX Runtime's full packages run the .onnx itself.")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--skip-memory-check", is_flag=True,
              help="Start even when the memory available now is below the export's estimated peak "
                   "(see `txl-deploy info CHECKPOINT --memory`).")
@threads_option
def export_cmd(checkpoint, to_onnx, executorch, output, mem_len, clamp_len, same_length, opset, state, max_segment,
               precision, block_size, calib, eval_text, config, preset, vocab, vocab_kind, representation, tokenizer, verify,
               ort_format, force,
               skip_memory_check, threads):
    """Export CHECKPOINT (any supported format, or a HuggingFace hub reference) to a self-describing ONNX model.

    The graph takes token ids [batch, segment] and the memory (a fixed ring buffer of projected keys and values per
    layer plus a per-row token counter) and returns log-probabilities and the memory update. Config, vocabulary
    and export settings are stored in the file's metadata, so the .onnx alone is enough to run it.

    --executorch writes the same step, with the same inputs and outputs in the same order, as an ExecuTorch program
    for Android and iOS apps (XNNPACK), checked in ExecuTorch's runtime against PyTorch at batch 2, 1 and 3 before
    it is written; its settings go into the sidecar NAME.pte.json.

    mem_len, clamp_len and same_length default to the checkpoint's values; published scores are often
    evaluated with others (NVIDIA evaluates WikiText-103 base with mem_len 640, clamp_len 400, same_length).

    --threads applies to the export, the checks against PyTorch and fp32, and the int8 calibration reader; ONNX
    Runtime's int8 calibrator runs its own session at ONNX Runtime's default threads.

    Memory: the export peaks at about 4x the checkpoint's size with its verification and 2.2x without
    (WikiText-103 large, 1.1 GB of weights: 4.5 GB and 2.5 GB). It refuses to start when the memory available now
    is below its estimate (`txl-deploy info CHECKPOINT --memory`), and says whether --no-verify would fit.

    A hub reference, hf://OWNER/NAME[@REVISION], is fetched into the HuggingFace hub cache (config.json, the
    PyTorch weights and the vocabulary only) and read as a HuggingFace folder; with HF_HUB_OFFLINE=1, or when the
    hub cannot be reached, the cache's copy is read. It needs the hub extra (from the checkout:
    pip install -e '.[hub]').

    \b
    Example:
      txl-deploy export model.pt --onnx -o model.onnx --mem-len 640
      txl-deploy export LM-TFM/ -o wt103.onnx --mem-len 640 --clamp-len 400 --same-length
      txl-deploy export hf://transfo-xl/transfo-xl-wt103 -o wt103.onnx
      txl-deploy export model.pt -o model.onnx --ort-format
      txl-deploy export model.pt --executorch --precision int4 --eval-text heldout.txt -o model-int4.pte
    """
    if isinstance(checkpoint, HubReference) and output is None:
        # not the snapshot folder's name, which is a commit hash
        output = f"{checkpoint.name}{'.pte' if executorch else '.onnx'}"
    checkpoint = local_model(checkpoint)
    export_checkpoint(checkpoint, output, precision=precision, vocab=vocab, vocab_kind=vocab_kind, config=config,
                      preset=preset, tokenizer=tokenizer, representation=representation, check_memory=not skip_memory_check,
                      mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, opset=opset, state=state,
                      max_segment=max_segment, verify=verify, force=force, threads=threads,
                      block_size=None if block_size is None else int(block_size), calib=calib, eval_text=eval_text,
                      ort_format=ort_format, executorch=executorch)


COMMANDS = [export_cmd]
