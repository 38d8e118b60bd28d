"""The Python-backend model's lazy adaptive-softmax requests, without a server (the stand-in stub): the head of a step
instead of the full log-probs, and tails of the latest distribution on request without moving the memory; every
value is the full distribution's own, and bad tail requests are refused without touching any conversation.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.triton_stub import Request, Tensor, load_model_module, start_model

from txl_deploy.serving.triton.protocol import HEAD_OUTPUT, TAIL_INPUT, TAIL_OUTPUT, cluster_bounds, head_column

HEAD, TAILS = [HEAD_OUTPUT], [TAIL_OUTPUT]


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lazy") / "repo"


@pytest.fixture(scope="module")
def model(tiny_onnx, repo_dir):
    return start_model(load_model_module(), tiny_onnx, repo_dir, max_batch=4, max_sequences=8)


def ask(model, *requests):
    responses = model.execute(list(requests))
    for r in responses:
        assert r.error is None, r.error
    return [r.outputs for r in responses]


def tail_request(corrid, clusters, dtype=np.int64):
    return Request(corrid, [], [], raw={TAIL_INPUT: Tensor(TAIL_INPUT, np.asarray(clusters, dtype).reshape(1, -1))},
                   outputs=TAILS)


def test_cluster_bounds_cover_the_vocabulary_after_the_shortlist():
    assert cluster_bounds([10, 30], 60) == [(10, 30), (30, 60)]
    assert cluster_bounds([], 60) == []
    assert [head_column([10, 30], i) for i in (1, 2)] == [11, 10]  # the original code's head_logprob[:, -i]


def test_head_and_tails_are_the_full_distributions_own(model, tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime

    clusters = cluster_bounds([10, 30], 60)
    with TxlRuntime.load(tiny_onnx) as alone:
        assert alone.config.cutoffs == [10, 30] and alone.n_token == 60
        prompt = [5, 17, 42, 3]
        full, = ask(model, Request(1, prompt, [1, 3], start=True))
        head, = ask(model, Request(2, prompt, [1, 3], start=True, outputs=HEAD))
        assert set(full) == {"log_probs"} and set(head) == {HEAD_OUTPUT}  # each gets what it asked for
        want = alone.step([prompt])[0, [1, 3]]
        np.testing.assert_allclose(full["log_probs"][0], want, rtol=0, atol=1e-5)
        lp = full["log_probs"][0]
        assert head[HEAD_OUTPUT].shape == (1, 2, 10 + 2)
        np.testing.assert_array_equal(head[HEAD_OUTPUT][0, :, :10], lp[:, :10])
        for i, (lo, hi) in enumerate(clusters, start=1):
            mass = np.log(np.exp(lp[:, lo:hi].astype(np.float64)).sum(-1))
            col = head[HEAD_OUTPUT][0, :, head_column([10, 30], i)]
            np.testing.assert_allclose(col, mass, rtol=0, atol=1e-5)
            assert (col[:, None] >= lp[:, lo:hi]).all()  # the bound a sampler relies on
        # tails of the latest distribution, in the order asked, without feeding anything
        for order in ([2], [1], [2, 1]):
            tails, = ask(model, tail_request(2, order))
            np.testing.assert_array_equal(tails[TAIL_OUTPUT][0],
                                          np.concatenate([lp[1, slice(*clusters[i - 1])] for i in order]))
        # the memory did not move: the next step of both conversations is the stream's next step
        a, b = ask(model, Request(1, [9], [0]), Request(2, [9], [0], outputs=HEAD + ["log_probs"]))
        np.testing.assert_allclose(a["log_probs"][0, 0], alone.step([[9]])[0, 0], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(a["log_probs"], b["log_probs"])
        # tails asked for in the same request as the tokens are those of the distribution after them
        c, = ask(model, Request(1, [4], [0], raw={TAIL_INPUT: Tensor(TAIL_INPUT, np.array([[1]]))},
                                outputs=HEAD + TAILS + ["log_probs"]))
        np.testing.assert_array_equal(c[TAIL_OUTPUT][0], c["log_probs"][0, 0, 10:30])
        ask(model, Request(1, [], [], end=True, want_state=True), Request(2, [], [], end=True, want_state=True))


@pytest.mark.parametrize("clusters, dtype, why", [
    ([1, 1], np.int64, "twice"), ([3], np.int64, "clusters 1..2"), ([0], np.int64, "clusters 1..2"),
    ([-1], np.int64, "clusters 1..2"), ([1.0], np.float32, "INT64"), ([], np.int64, "K >= 1"),
    ([1, 2, 1], np.int64, "longer than this server")])
def test_bad_tail_requests_are_refused_and_change_nothing(model, clusters, dtype, why):
    before, = ask(model, Request(3, [5, 6], [1], start=True))
    answer = model.execute([tail_request(3, clusters, dtype)])[0]
    assert answer.error is not None and why in answer.error
    after, = ask(model, Request(3, [], [], end=True, want_state=True))  # the latest distribution, unchanged
    np.testing.assert_array_equal(after["log_probs"], before["log_probs"])


def test_tails_need_a_known_distribution(model):
    ask(model, Request(4, [5], [0], start=True))  # its distribution is of position 0 of a 1-token segment: known
    ok, = ask(model, tail_request(4, [1]))
    assert ok[TAIL_OUTPUT].shape == (1, 20)
    ask(model, Request(4, [5, 6], [0]))  # only an earlier position's: the next-token distribution is unknown
    answer = model.execute([tail_request(4, [1])])[0]
    assert answer.error is not None and "no next-token distribution" in answer.error
    ask(model, Request(4, [], [], end=True, want_state=True))


def test_a_plain_softmax_model_declares_and_answers_no_head_or_tails(tmp_path):
    from helpers.tiny import TINY_VOCAB, make_tiny_model

    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.vocab import Vocab

    save_checkpoint(tmp_path / "plain", make_tiny_model(cutoffs=[], div_val=1, tie_projs=[False]), Vocab(TINY_VOCAB))
    export_onnx(tmp_path / "plain", tmp_path / "plain.onnx", max_segment=4)
    model = start_model(load_model_module(), tmp_path / "plain.onnx", tmp_path / "repo", max_batch=2,
                        max_sequences=2)
    config = (tmp_path / "repo" / "txl" / "config.pbtxt").read_text()
    assert HEAD_OUTPUT not in config and TAIL_INPUT not in config  # Triton refuses them before the model sees them
    for request in (Request(1, [1], [0], start=True, outputs=HEAD), tail_request(1, [1])):
        answer = model.execute([request])[0]
        assert answer.error is not None and "no adaptive softmax" in answer.error


def test_the_repository_declares_the_lazy_tensors(model, repo_dir):
    from txl_deploy.serving.triton.protocol import CUTOFFS_PARAM

    config = (repo_dir / "txl" / "config.pbtxt").read_text()
    assert f'name: "{TAIL_INPUT}" data_type: TYPE_INT64 dims: [ -1 ] optional: true' in config
    assert f'name: "{HEAD_OUTPUT}" data_type: TYPE_FP32 dims: [ -1, 12 ]' in config
    assert f'name: "{TAIL_OUTPUT}" data_type: TYPE_FP32 dims: [ -1 ]' in config
    assert CUTOFFS_PARAM in config
