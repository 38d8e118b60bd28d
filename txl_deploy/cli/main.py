"""The `txl-deploy` group: every command, one-line errors, and where the library's messages go.

Each command lives in its own module and only parses and prints; the work is done by the library. Nothing here
imports torch, onnxruntime or tensorrt (the library imports them when a command needs them), so `--help` is fast
and works on a machine that has only the runtime dependencies. Every `TxlError` becomes a one-line message on
stderr and exit code 2.
"""

from __future__ import annotations

import sys

import click

from txl_deploy import __version__
from txl_deploy.cli import (
    bench,
    build_engine,
    convert,
    demo,
    evaluate,
    export,
    generate,
    info,
    midi,
    score,
    serve,
    serve_client,
    triton_repo,
    triton_server,
    verify,
    web_demo,
)
from txl_deploy.cli.output import command_output
from txl_deploy.errors import TxlError, missing_package_hint

COMMAND_MODULES = (convert, info, export, verify, generate, midi, evaluate, score, bench, build_engine, triton_repo,
                   triton_server, serve, serve_client, web_demo, demo)


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TxlError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except ModuleNotFoundError as e:  # an optional dependency a command needs: name the extra that brings it
            hint = missing_package_hint(e)
            if hint is None:
                raise
            click.echo(f"error: {hint}", err=True)
            sys.exit(TxlError.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="txl-deploy")
@click.option("-v", "--verbose", count=True, help="Also show debug messages and other libraries' warnings.")
@click.option("-q", "--quiet", is_flag=True, help="Show only warnings and errors besides the results.")
@click.pass_context
def main(ctx, verbose, quiet):
    """Deploy a trained Transformer-XL: convert checkpoints, export ONNX with the memory as explicit graph
    inputs/outputs, build TensorRT engines, generate, evaluate, benchmark and serve.

    Run `txl-deploy COMMAND --help` for each command.
    """
    ctx.with_resource(command_output(verbose, quiet))


for _module in COMMAND_MODULES:
    for _command in _module.COMMANDS:
        main.add_command(_command)
