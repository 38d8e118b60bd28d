"""`txl-deploy verify`: an exported graph or engine against the PyTorch reference, on a multi-segment stream."""

from __future__ import annotations

import sys

import click

from txl_deploy.cli.options import threads_option
from txl_deploy.exporters.onnx.verify import verify_file


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
    report = verify_file(model, checkpoint, tolerance=tolerance, batch=batch, seed=seed,
                         providers=providers.split(",") if providers else None, threads=threads)
    click.echo(f"precision           {report['precision']}")
    click.echo(f"max abs difference  {report['max_abs_diff']:.3g}")
    click.echo(f"KL divergence       {report['kl_divergence']:.3g} nats per position")
    click.echo(f"top-1 agreement     {report['top1_agreement']:.4f}  over {report['tokens']} positions, "
               f"batch {batch}, segments {report['segments']}")
    click.echo(f"tolerance           {report['criterion']}")
    click.echo("OK" if report["passed"] else "MISMATCH")
    sys.exit(0 if report["passed"] else 1)


COMMANDS = [verify_cmd]
