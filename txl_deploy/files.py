"""Atomic output files: nothing the user had is lost, and no half-written file is left behind."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from txl_deploy.errors import OutputExistsError


def check_writable(path, force=False):
    path = Path(path)
    if path.exists() and not force:
        raise OutputExistsError(path)
    return path


@contextlib.contextmanager
def atomic_path(path, force=False):
    """Yield a temporary path beside `path`; move it into place only if the block succeeds.

    Works for files and directories. The temporary lives in the same directory so the final rename is
    atomic on one file system; on any exception (KeyboardInterrupt included) it is removed.
    """
    path = check_writable(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    tmp = Path(tmp_dir) / path.name
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
