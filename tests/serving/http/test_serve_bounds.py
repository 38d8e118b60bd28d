"""What a long-running server keeps grows to a bound, not with the traffic: the sessions that are gone are remembered
(for the 404 that says why) up to FORGOTTEN_KEPT, the oldest forgotten first, and the memory they take stops
growing there however many more sessions come and go."""

from __future__ import annotations

import tracemalloc

import pytest

pytest.importorskip("fastapi", reason="pip install 'txl-deploy[serve]'")

from txl_deploy.serving.http.protocol import ApiError  # noqa: E402
from txl_deploy.serving.http.sessions import FORGOTTEN_KEPT, GONE, SessionStore  # noqa: E402


def _churn(store: SessionStore, prefix: str, n: int):
    """n sessions created and deleted, as clients that never come back leave them."""
    for i in range(n):
        store.create(f"{prefix}-{i}")
        store.remove(f"{prefix}-{i}", f"was deleted; {GONE}")


def _code(store: SessionStore, id_: str) -> str:
    with pytest.raises(ApiError) as e:
        store.get(id_)
    return e.value.code


def test_gone_sessions_are_remembered_up_to_a_bound():
    store = SessionStore(max_sessions=4, ttl=None, on_drop=lambda session, why: None)
    _churn(store, "warm", FORGOTTEN_KEPT)  # the memory of gone sessions is full from here on
    tracemalloc.start()
    try:
        _churn(store, "a", FORGOTTEN_KEPT)
        full = tracemalloc.get_traced_memory()[0]
        _churn(store, "b", 4 * FORGOTTEN_KEPT)
        grown = tracemalloc.get_traced_memory()[0] - full
    finally:
        tracemalloc.stop()
    # 4 x FORGOTTEN_KEPT more sessions gone: not one more entry kept (an entry takes a few hundred bytes)
    assert grown < 32 * 1024, f"{grown:,} bytes more after {4 * FORGOTTEN_KEPT:,} more sessions"
    assert len(store) == 0
    assert _code(store, f"b-{4 * FORGOTTEN_KEPT - 1}") == "session_gone"  # the latest: why it is gone
    assert _code(store, f"b-{3 * FORGOTTEN_KEPT}") == "session_gone"  # the oldest kept
    assert _code(store, f"b-{3 * FORGOTTEN_KEPT - 1}") == "session_not_found"  # forgotten
