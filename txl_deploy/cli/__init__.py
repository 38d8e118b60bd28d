"""`txl-deploy`, the command line: the group is `main` (cli/main.py); each command is a module of its own."""

from txl_deploy.cli.main import main

__all__ = ["main"]
