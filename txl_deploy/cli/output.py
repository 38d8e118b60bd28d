"""What the command line shows besides a command's own results: the library's log messages and warnings.

The library reports through `logging` (the `txl_deploy` logger) and `warnings`; nothing in it prints. A command
shows its INFO messages on stderr (DEBUG with -v, only WARNING and above with -q), and only txl-deploy's own
warnings: the deprecation and tracing notices that torch, onnxscript and other libraries raise during an export
say nothing a user can act on, nor do other libraries' log records below ERROR (-v shows both). These settings
are undone when the command ends, so commands invoked in-process (tests, notebooks) leave the caller's logging as
it was.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import click

LOGGER = "txl_deploy"


class EchoHandler(logging.Handler):
    """Log records as lines on stderr, through click (so CliRunner and pipes see them). Warnings say so."""

    def emit(self, record):
        try:
            message = self.format(record)
            if record.levelno >= logging.WARNING:
                message = f"{record.levelname.lower()}: {message}"
            click.echo(message, err=True)
        except Exception:  # noqa: BLE001 - logging must never take the command down
            self.handleError(record)


@contextlib.contextmanager
def command_output(verbose: int = 0, quiet: bool = False):
    """Route the `txl_deploy` logger to stderr and filter third-party warnings for the duration of a command."""
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    logger = logging.getLogger(LOGGER)
    handler = EchoHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    old_level, old_propagate, old_root = logger.level, logger.propagate, root.level
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the root logger's handlers (if the caller set any) would print every line twice
    if not verbose:  # other libraries' records (torchao's "Failed to load" its optional kernels, ...)
        root.setLevel(max(old_root, logging.ERROR))
    try:
        with warnings.catch_warnings():
            if not verbose:
                warnings.filterwarnings("ignore")
                warnings.filterwarnings("default", module=LOGGER)  # ours are meant for the user
            warnings.showwarning = _show_warning  # restored by catch_warnings
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
        root.setLevel(old_root)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    click.echo(f"warning: {message}", err=True)
