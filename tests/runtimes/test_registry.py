"""Opening a file picks its backend, and asking an exported graph for settings it was not built with says so."""

from __future__ import annotations

import numpy as np
import pytest

from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime


def test_a_shorter_max_segment_splits_input_and_gives_the_same_log_probs(tiny_onnx):
    tokens = np.random.default_rng(0).integers(0, 60, size=(2, 20))
    with TxlRuntime.load(tiny_onnx) as whole, TxlRuntime.load(tiny_onnx, max_segment=3) as pieces:
        assert pieces.backend.max_segment == 3
        np.testing.assert_allclose(pieces.step(tokens), whole.step(tokens), atol=1e-5)


def test_a_longer_max_segment_than_the_graph_was_built_for_is_refused(tiny_onnx):
    with pytest.raises(InputError, match="exported with max_segment=16; re-export"):
        TxlRuntime.load(tiny_onnx, max_segment=17)
