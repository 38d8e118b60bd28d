"""`txl-deploy`: the command line. Each command lives in `txl_deploy/commands/<name>.py`.

Commands import torch, onnxruntime or tensorrt inside their bodies, so `txl-deploy --help` stays fast and works
on a machine that has only the runtime dependencies. Every `TxlError` becomes a one-line message and exit code 2.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import TxlError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TxlError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="txl-deploy")
def main():
    """Deploy a trained Transformer-XL: convert checkpoints, export ONNX with the memory as explicit graph
    inputs/outputs, build TensorRT engines, generate, evaluate and benchmark.

    Run `txl-deploy COMMAND --help` for each command.
    """


def _register():
    import importlib
    import pkgutil

    from . import commands

    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{mod.name}")
        for command in getattr(module, "COMMANDS", ()):
            main.add_command(command)


_register()
