"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module's tests, restored after."""
    torch = pytest.importorskip("torch")
    # These models are tiny: with several intra-op threads on a busy 2-core machine each op waits on the others.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
