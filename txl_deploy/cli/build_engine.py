"""`txl-deploy build-engine`: a TensorRT engine (plus its JSON sidecar) from an ONNX file exported by txl-deploy."""

from __future__ import annotations

import click

from txl_deploy.errors import TxlError
from txl_deploy.exporters.tensorrt.build import DEFAULT_BATCH, parse_range
from txl_deploy.exporters.tensorrt.build import build_engine as build


def _range(what):
    def convert(ctx, param, value):
        if value is None:
            return None

        try:
            return parse_range(value, what)
        except TxlError as e:
            raise click.BadParameter(str(e)) from None

    return convert


@click.command("build-engine")
@click.argument("onnx_path", metavar="MODEL.onnx", type=click.Path(dir_okay=False))
@click.option("--fp16", "precision", flag_value="fp16",
              help="Build an FP16 engine. The ONNX must be an FP16 export (`txl-deploy export CKPT --onnx "
                   "--precision fp16`): TensorRT 11 takes precision from the graph.")
@click.option("--int8", "precision", flag_value="int8",
              help="Build an INT8 engine from an ONNX with symmetric Q/DQ (`txl-deploy export CKPT --onnx "
                   "--precision int8 --calib FILE`).")
@click.option("--calib", type=click.Path(dir_okay=False), default=None,
              help="Calibration text (or .npy of token ids) for --int8; the Q/DQ graph is made by `txl-deploy export`.")
@click.option("--batch", callback=_range("batch"), default=None, metavar="MIN:OPT:MAX",
              help="Batch sizes the engine accepts, and the one it is tuned for. [default: 1:1:8]")
@click.option("--segment", callback=_range("segment"), default=None, metavar="MIN:OPT:MAX",
              help="Tokens per call the engine accepts (MAX <= the graph's max_segment). "
                   "[default: 1:1:max_segment; OPT 1 tunes for decoding]")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None,
              help="TensorRT timing cache file: read if present, updated after the build (faster rebuilds).")
@click.option("--workspace", type=click.IntRange(min=1), default=None, metavar="MiB",
              help="Limit TensorRT's builder workspace memory to this many MiB. [default: TensorRT's]")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Engine file to write (a MODEL.engine.json sidecar goes next to it). [default: MODEL.engine]")
@click.option("--force", is_flag=True, help="Overwrite an existing engine and sidecar.")
def build_engine(onnx_path, precision, calib, batch, segment, timing_cache, workspace, output, force):
    """Build a TensorRT engine from MODEL.onnx (exported with `txl-deploy export CKPT --onnx`).

    Needs TensorRT (10.3+ or 11.x) and an NVIDIA GPU; the engine only runs on the TensorRT version and GPU
    architecture it was built with. The graph is checked for TensorRT compatibility first.
    """
    build(onnx_path, output, precision=precision, batch=batch or DEFAULT_BATCH, segment=segment,
          timing_cache=timing_cache, workspace=workspace, force=force, calib=calib)


COMMANDS = [build_engine]
