"""`bench`: per-token latency, throughput and memory of a runtime backend against the PyTorch eager reference."""

from __future__ import annotations

import click

from txl_deploy.bench import run_benchmark
from txl_deploy.bench.op_profile import profile_table
from txl_deploy.bench.report import plot as write_plot
from txl_deploy.bench.report import table, write_json
from txl_deploy.cli.options import threads_option
from txl_deploy.errors import InputError
from txl_deploy.files import check_writable


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        out = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"expected integers >= 1, got {value!r}")
    return out


@click.command("bench")
@click.argument("model")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "executorch", "torch", "torch-fast"]),
              help="Backend under test [default: onnxruntime, tensorrt for an engine, executorch for a .pte].")
@click.option("--baseline", type=click.Choice(["eager", "none"]), default="eager", show_default=True,
              help="Also measure the PyTorch eager reference in the same run, interleaved, and report speedups. "
                   "Eager runs the model body, then its output layer only at the positions a caller needs (the "
                   "last one of a prompt), as text generation does.")
@click.option("--eager-as-written", is_flag=True,
              help="Also time the prefill of eager as MemTransformerLM.forward computes it: the output layer at "
                   "every prompt position (V log-probs per position), then the last one kept.")
@click.option("--compare", type=click.Path(exists=True, dir_okay=False),
              help="Also measure this .onnx file (e.g. the fp32 graph a reduced-precision MODEL was converted from) "
                   "in the same run, interleaved, on the same backend settings; reports the speedup against it.")
@click.option("--reference", type=click.Path(exists=True),
              help="Checkpoint an .onnx/.engine MODEL was exported from (needed for the eager baseline).")
@click.option("--batch", default="1", callback=_int_list, show_default=True,
              help="Batch sizes, comma-separated (each row is an independent stream).")
@click.option("--mem-len", callback=_int_list,
              help="Memory lengths, comma-separated [default: the model's]; a checkpoint or shape is exported per "
                   "length. An exported MODEL has its own.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens in the timed prefill (from an empty memory).")
@click.option("--gen-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Timed single-token decode steps per repeat, each with a full memory.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Untimed decode steps (and one prefill) per side before timing.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Repeats; the two sides alternate within each repeat (A B, B A, ...).")
@click.option("--device", default="cpu", show_default=True,
              help="cpu or cuda[:N]: where the torch backends run, and ONNX Runtime's CUDA provider when cuda.")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt) [default: by --device].")
@threads_option
@click.option("--state", type=click.Choice(["incremental", "full"]), default="incremental", show_default=True,
              help="Graph layout when MODEL is exported on the fly ('full' keeps ORT CUDA's memory on the device).")
@click.option("--cache-dir", type=click.Path(file_okay=False),
              help="Keep stand-ins and on-the-fly exports here for later runs [default: a temporary directory].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the token stream.")
@click.option("--profile", is_flag=True, help="Also profile one ONNX Runtime decode step and print time per op type.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the full results as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Plot latency against memory length and batch size (needs matplotlib).")
@click.option("--force", is_flag=True, help="Overwrite existing --json / --plot files.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_cmd(model, backend, baseline, eager_as_written, compare, reference, batch, mem_len, prompt_len, gen_len,
              warmup, repeat, device, providers, threads, state, cache_dir, seed, profile, json_out, plot, force, quiet):
    """Measure MODEL: per-token decode latency (p50/p90/p99) with a full memory, generated tokens/s, prefill
    tokens/s and peak memory, for the chosen backend and for the PyTorch eager reference in the same run.
    Nothing else runs while a call is timed: peak memory comes from a separate, untimed pass.

    MODEL is an .onnx file, a TensorRT .engine, an ExecuTorch .pte, a checkpoint, or a published shape name
    (enwik8-base, wt103-base, the music models remi and remi-xl, ...) which runs a random-weight stand-in of that
    shape. Both sides see the same token stream; their log-probabilities are compared and the largest difference
    is reported.

    \b
    Examples:
      txl-deploy bench enwik8-base --mem-len 100,2100 --gen-len 32
      txl-deploy bench model.onnx --reference ckpt/ --batch 1,8 --json out.json
    """
    for path in (json_out, plot):
        if path:
            check_writable(path, force)
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("--plot needs matplotlib (pip install matplotlib)") from None

    provs = [p.strip() for p in providers.split(",")] if providers else None
    report = run_benchmark(model, backend=backend, baseline=baseline, reference=reference, batches=batch,
                           mem_lens=mem_len, prompt_len=prompt_len, gen_len=gen_len, warmup=warmup, repeat=repeat,
                           device=device, threads=threads, providers=provs, state=state, cache_dir=cache_dir,
                           seed=seed, profile=profile, as_written_batches=batch if eager_as_written else (),
                           compare=compare, progress=not quiet)
    if json_out:  # first: a long run's results are never lost to a later step
        write_json(report, json_out, force)
        click.echo(f"wrote {json_out}", err=True)
    click.echo(table(report))
    if profile:
        for res in report["results"]:
            if res.get("profile"):
                click.echo(f"\nmem_len {res['mem_len']} batch {res['batch']}, " + profile_table(res["profile"]))
    if plot:
        write_plot(report, plot, force)
        click.echo(f"wrote {plot}", err=True)


COMMANDS = [bench_cmd]
