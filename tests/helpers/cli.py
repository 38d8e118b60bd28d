"""The command line, invoked in-process."""

from __future__ import annotations

from click.testing import CliRunner

from txl_deploy.cli import main


def cli(*args):
    """`txl-deploy ARGS...` (each argument str()-ed); the click Result."""
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *fragments):
    """A usage error (exit 2) reported on one line starting `error: `, naming every fragment, without a traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message
