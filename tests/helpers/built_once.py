"""Artefacts built once per test run, however many pytest-xdist workers ask for them.

A session-scoped fixture runs once per worker process, so every worker would pay for the same export. `built_once`
builds a folder under the run's own temporary directory (shared by its workers) behind a file lock: the first worker
to ask builds it, the others wait and reuse it. A marker beside the folder (`NAME.complete`, so the folder holds only
what the build wrote), made last, says it is whole; a folder without one (a build that raised) is built again.
Callers must treat what they get as read-only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def run_root(tmp_path_factory) -> Path:
    """The temporary directory of this run, the same for all its workers."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is <the run's>/popen-gwN. Without xdist the parent is shared by every run
    # (pytest-of-USER), so the worker's own basetemp is used.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `build(folder)` once per run."""
    root = run_root(tmp_path_factory) / "built-once"
    root.mkdir(exist_ok=True)
    folder, complete = root / name, root / f"{name}.complete"
    with FileLock(str(root / f"{name}.lock")):
        if not complete.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            complete.touch()
    return folder
