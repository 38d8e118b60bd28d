"""Progress bars for long work (exports, calibration, evaluation, benchmarks), following the library's logging.

A bar is progress information, so it shows when the `txl_deploy` logger shows INFO messages (the command line's
default; `-q` hides both) and stderr is a terminal (tqdm's own rule: a log file or a pipe gets no bar). A program
that imports txl-deploy sees bars once it configures logging at INFO for `txl_deploy`.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

LOGGER = logging.getLogger("txl_deploy")


def progress_bar(*, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar (keyword arguments as tqdm's) that is disabled unless `enabled` and INFO is shown."""
    show = enabled and LOGGER.isEnabledFor(logging.INFO)
    return tqdm(disable=None if show else True, **{"leave": False, **kwargs})
