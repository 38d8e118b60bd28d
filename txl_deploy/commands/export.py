"""`export`, `verify` and `generate`: the ONNX path from a checkpoint to text."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import InputError
from . import threads_option

STATE_HELP = ("memory layout of the graph: 'incremental' outputs only this segment's keys/values (the runtime "
              "updates its ring buffer in place; fastest), 'full' outputs the whole next state (Triton implicit "
              "state, ping-pong GPU buffers)")


@click.command("export")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--onnx", "to_onnx", is_flag=True, default=True, help="Export to ONNX (the default and only target).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Output file [default: CHECKPOINT name + .onnx].")
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
              "int4: 4-bit weights (ONNX Runtime MatMulNBits, CPU and browser; not TensorRT).")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128", "256"]),
              help="--precision int4: weights per block sharing one scale (larger: smaller file, coarser). "
                   "[default: 32]")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False),
              help="Calibration data for --precision int8: text (tokenized with the model's vocabulary) or a .npy of "
                   "token ids.")
@click.option("--eval-text", type=click.Path(exists=True, dir_okay=False),
              help="Held-out text for measuring the accuracy change of reduced precision [default: calibration text].")
@click.option("--vocab", type=click.Path(exists=True, dir_okay=False), help="Vocabulary file, if the checkpoint has none.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check ONNX Runtime against the PyTorch reference on a multi-segment stream; fail on a mismatch.")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--skip-memory-check", is_flag=True,
              help="Start even when the memory available now is below the export's estimated peak "
                   "(see `txl-deploy info CHECKPOINT --memory`).")
@threads_option
def export_cmd(checkpoint, to_onnx, output, mem_len, clamp_len, same_length, opset, state, max_segment, precision,
               block_size, calib, eval_text, vocab, verify, force, skip_memory_check, threads):
    """Export CHECKPOINT (any supported format) to a self-describing ONNX model.

    The graph takes token ids [batch, segment] and the memory (a fixed ring buffer of projected keys and values per
    layer plus a per-row token counter) and returns log-probabilities and the memory update. Config, vocabulary
    and export settings are stored in the file's metadata, so the .onnx alone is enough to run it.

    mem_len, clamp_len and same_length default to the checkpoint's values; published scores are often
    evaluated with others (NVIDIA evaluates WikiText-103 base with mem_len 640, clamp_len 400, same_length).

    --threads applies to the export, the checks against PyTorch and fp32, and the int8 calibration reader; ONNX
    Runtime's int8 calibrator runs its own session at ONNX Runtime's default threads.

    Memory: the export peaks at about 4x the checkpoint's size with its verification and 2.2x without
    (WikiText-103 large, 1.1 GB of weights: 4.5 GB and 2.5 GB). It refuses to start when the memory available now
    is below its estimate (`txl-deploy info CHECKPOINT --memory`), and says whether --no-verify would fit.

    \b
    Example:
      txl-deploy export model.pt --onnx -o model.onnx --mem-len 640
      txl-deploy export LM-TFM/ -o wt103.onnx --mem-len 640 --clamp-len 400 --same-length
    """
    from ..checkpoints import load_model

    if block_size is not None and precision != "int4":
        raise InputError(f"--block-size is for --precision int4, not {precision}")
    out = Path(output) if output else Path(Path(checkpoint).name.split(".")[0] + ".onnx")
    if threads:
        import torch

        torch.set_num_threads(threads)  # the export trace and the PyTorch reference of the verification
    loaded = load_model(checkpoint, **({"vocab": vocab} if vocab else {}))
    if not skip_memory_check:
        from ..memory import check_export_fits, export_peaks, loaded_weight_bytes

        cfg = loaded.config
        check_export_fits(export_peaks(cfg, loaded_weight_bytes(loaded), mem_len or cfg.mem_len, max_segment), verify)
    if precision == "fp32":
        from ..exporters.onnx import export_onnx

        export_onnx(loaded, out, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, opset=opset,
                    state=state, max_segment=max_segment, verify=verify, force=force, log=click.echo,
                    threads=threads, consume=True)
    else:
        from ..exporters.precision import export_reduced

        options = {"int4_block_size": int(block_size)} if block_size is not None else {}
        export_reduced(loaded, out, precision=precision, calib=calib, eval_text=eval_text, mem_len=mem_len,
                       clamp_len=clamp_len, same_length=same_length, opset=opset, state=state,
                       max_segment=max_segment, verify=verify, force=force, log=click.echo, threads=threads,
                       consume=True, **options)


@click.command("verify")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--against", "checkpoint", required=True, type=click.Path(exists=True),
              help="The checkpoint the model was exported from (the PyTorch reference).")
@click.option("--tolerance", type=float, help="fp32: absolute part of |diff| <= TOL + 1e-5 x |log-prob| [default 1e-4]; "
              "reduced precision: mean KL divergence in nats [default fp16 1e-3, int8 0.1].")
@click.option("--batch", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt) [default: automatic].")
@threads_option
def verify_cmd(model, checkpoint, tolerance, batch, seed, providers, threads):
    """Check an exported MODEL against the PyTorch reference built from CHECKPOINT on a multi-segment stream
    (partly empty memory, batch > 1, Q = 1 and Q > 1, ring wrap-around). Exit code 1 on a mismatch."""
    from ..checkpoints import load_model
    from ..exporters.verify import ReferenceStream, compare_stream, judge, verification_segments
    from ..memory import log_prob_budget, weight_file_bytes
    from ..metadata import read_onnx_info
    from ..runtimes import TxlRuntime

    if threads:
        import torch

        torch.set_num_threads(threads)  # the PyTorch reference
    # The reference pass runs before the runtime loads, and only its output layer is kept for the comparison:
    # the two models' weights are never in memory together (see exporters.verify.ReferenceStream).
    load = dict(providers=providers.split(",") if providers else None, threads=threads)
    if Path(model).suffix == ".onnx":
        info = read_onnx_info(model)
        config, mem_len, max_segment = info.config, info.mem_len, info.max_segment
    else:  # an engine describes itself once loaded
        with TxlRuntime.load(model, **load) as rt:
            config, mem_len, max_segment = rt.config, rt.mem_len, rt.backend.max_segment
    reference = load_model(checkpoint).build().reset_length(mem_len)
    if reference.cfg.replace(mem_len=0) != config.replace(mem_len=0):
        raise InputError(f"{model} was not exported from {checkpoint}: their configs differ")
    stream = ReferenceStream(reference, verification_segments(mem_len, max_segment), batch, seed)
    del reference
    with TxlRuntime.load(model, **load) as rt:
        budget = log_prob_budget(weight_file_bytes(model))
        report = judge(compare_stream(rt, stream, log_prob_bytes=budget), rt.backend.precision, tolerance)
    click.echo(f"precision           {report['precision']}")
    click.echo(f"max abs difference  {report['max_abs_diff']:.3g}")
    click.echo(f"KL divergence       {report['kl_divergence']:.3g} nats per position")
    click.echo(f"top-1 agreement     {report['top1_agreement']:.4f}  over {report['tokens']} positions, "
               f"batch {batch}, segments {report['segments']}")
    click.echo(f"tolerance           {report['criterion']}")
    click.echo("OK" if report["passed"] else "MISMATCH")
    sys.exit(0 if report["passed"] else 1)


@click.command("generate")
@click.argument("model", type=click.Path(exists=True))
@click.option("--prompt", required=True, help="Text to start from.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=200, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=1), help="Sample from the k most likely tokens.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="Nucleus sampling threshold.")
@click.option("--seed", type=int, help="Seed for reproducible sampling.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "torch", "torch-fast"]),
              help="[default: by file type: .onnx -> onnxruntime, .engine -> tensorrt, checkpoint -> torch]")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt).")
@threads_option
def generate_cmd(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, backend, providers, threads):
    """Stream text generated from MODEL (an .onnx, an .engine or a checkpoint) after PROMPT."""
    from ..runtimes import TxlRuntime

    with TxlRuntime.load(model, backend=backend, providers=providers.split(",") if providers else None,
                         threads=threads) as rt:
        if rt.vocab is None:
            raise InputError(f"{model}: has no vocabulary, so it cannot read a text prompt")
        click.echo(prompt, nl=False)
        for tok in rt.generate(prompt, max_new_tokens, temperature, top_k, top_p, seed):
            click.echo(rt.vocab.piece(tok), nl=False)
            sys.stdout.flush()
        click.echo()


COMMANDS = [export_cmd, verify_cmd, generate_cmd]
