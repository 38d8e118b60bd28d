"""Fixtures of the serving tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tritonserver():
    """The tritonserver the serving tests run (found as `TritonServer` finds it: $TXL_TRITONSERVER, nvidia-pytriton's
    under .venv/triton or in site-packages, or PATH). A test that needs a real server takes this fixture, and skips
    with the command that installs one where there is none."""
    from txl_deploy.serving.triton.local_server import TritonLaunchError, find_tritonserver

    try:
        return find_tritonserver()
    except TritonLaunchError as e:
        pytest.skip(str(e))
