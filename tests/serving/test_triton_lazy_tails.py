"""The Python-backend model's lazy adaptive-softmax requests, without a server (the stand-in stub): the head of a step
instead of the full log-probs, and tails of the latest distribution on request without moving the memory; every
value is the full distribution's (within float32 rounding: the head and tail graphs compute them), the model runs
the head graph for a head-only step and only the tail graphs asked for, and bad tail requests are refused without
touching any conversation.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.triton_stub import Request, Tensor, load_model_module, start_model

from txl_deploy.contract.clusters import Clusters
from txl_deploy.serving.triton.protocol import HEAD_OUTPUT, TAIL_INPUT, TAIL_OUTPUT

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
    layout = Clusters.from_cutoffs([10, 30], 60)
    assert layout.bounds == ((10, 30), (30, 60)) and layout.shortlist == 10 and layout.cutoffs == [10, 30]
    assert Clusters.from_cutoffs([], 60) is None
    assert [layout.head_column(i) for i in (1, 2)] == [11, 10]  # the original code's head_logprob[:, -i]


def test_head_and_tails_are_the_full_distributions_own(model, tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime

    layout = Clusters.from_cutoffs([10, 30], 60)
    clusters = layout.bounds
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
        np.testing.assert_allclose(head[HEAD_OUTPUT][0, :, :10], lp[:, :10], rtol=0, atol=1e-5)
        for i, (lo, hi) in enumerate(clusters, start=1):
            mass = np.log(np.exp(lp[:, lo:hi].astype(np.float64)).sum(-1))
            col = head[HEAD_OUTPUT][0, :, layout.head_column(i)]
            np.testing.assert_allclose(col, mass, rtol=0, atol=1e-5)
            assert (col[:, None] >= lp[:, lo:hi]).all()  # the bound a sampler relies on
        # tails of the latest distribution, in the order asked, without feeding anything
        for order in ([2], [1], [2, 1]):
            tails, = ask(model, tail_request(2, order))
            np.testing.assert_allclose(tails[TAIL_OUTPUT][0],
                                       np.concatenate([lp[1, slice(*clusters[i - 1])] for i in order]),
                                       rtol=0, atol=1e-5)
        # the memory did not move: the next step of both conversations is the stream's next step
        a, b = ask(model, Request(1, [9], [0]), Request(2, [9], [0], outputs=HEAD + ["log_probs"]))
        np.testing.assert_allclose(a["log_probs"][0, 0], alone.step([[9]])[0, 0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(a["log_probs"], b["log_probs"], rtol=0, atol=1e-5)
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


def counts(model):
    return {"head": model.counts["head"], "full": model.counts["full"], "tails": list(model.counts["tails"])}


def test_a_head_only_step_runs_the_head_graph_and_tails_run_only_when_asked(model, tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime

    assert model.lazy and model.backend.clusters is not None  # the repository carries the parts
    prompt = [5, 17, 42, 3]
    before = counts(model)
    head, = ask(model, Request(11, prompt, [3], start=True, outputs=HEAD))
    assert counts(model) == {**before, "head": before["head"] + 1}  # no full graph, no tail
    tail, = ask(model, tail_request(11, [2]))
    assert counts(model)["tails"] == [before["tails"][0], before["tails"][1] + 1] and \
        counts(model)["full"] == before["full"]
    with TxlRuntime.load(tiny_onnx) as alone:
        lp = alone.step([prompt])[0, -1]
        np.testing.assert_allclose(head[HEAD_OUTPUT][0, 0, :10], lp[:10], rtol=0, atol=1e-5)
        np.testing.assert_allclose(tail[TAIL_OUTPUT][0], lp[30:60], rtol=0, atol=1e-5)
        # a full step after head-only ones: the memory the head graph left is the full graph's
        full, = ask(model, Request(11, [7, 8], [0, 1]))
        np.testing.assert_allclose(full["log_probs"][0], alone.step([[7, 8]])[0], rtol=0, atol=1e-5)
    assert counts(model)["full"] == before["full"] + 1
    ask(model, Request(11, [], [], end=True, want_state=True))


def test_a_batch_mixing_full_and_head_requests_gets_each_its_own(model, tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime

    prompt = [4, 33, 12]
    before = counts(model)
    full, head = ask(model, Request(12, prompt, [2], start=True), Request(13, prompt, [2], start=True, outputs=HEAD))
    assert set(full) == {"log_probs"} and set(head) == {HEAD_OUTPUT}
    assert counts(model)["full"] == before["full"] + 1 and counts(model)["head"] == before["head"] + 1
    with TxlRuntime.load(tiny_onnx) as alone:
        lp = alone.step([prompt])[0, -1]
    np.testing.assert_allclose(full["log_probs"][0, 0], lp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(head[HEAD_OUTPUT][0, 0, :10], lp[:10], rtol=0, atol=1e-5)
    ask(model, Request(12, [], [], end=True, want_state=True), Request(13, [], [], end=True, want_state=True))


def test_a_park_after_a_head_only_step_carries_the_full_distribution(model, tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime

    prompt = [9, 21, 50, 2, 6]
    ask(model, Request(14, prompt, [4], start=True, outputs=HEAD))
    before = counts(model)
    parked, = ask(model, Request(14, [], [], end=True, want_state=True))  # log_probs: composed from the parts
    assert counts(model)["tails"] == [t + 1 for t in before["tails"]] and counts(model)["full"] == before["full"]
    with TxlRuntime.load(tiny_onnx) as alone:
        lp = alone.step([prompt])[0, -1]
        np.testing.assert_allclose(parked["log_probs"][0, 0], lp, rtol=0, atol=1e-5)
        # the parked state is the usual one: resumed here it answers tails from its distribution, and continues
        resumed, = ask(model, Request(15, [], [], start=True, resume=parked["saved_state"].tobytes(),
                                      outputs=["log_probs"]))
        np.testing.assert_array_equal(resumed["log_probs"], parked["log_probs"])
        tails, = ask(model, tail_request(15, [1]))
        np.testing.assert_array_equal(tails[TAIL_OUTPUT][0], parked["log_probs"][0, 0, 10:30])
        nxt, = ask(model, Request(15, [3], [0], outputs=HEAD))
        np.testing.assert_allclose(nxt[HEAD_OUTPUT][0, 0, :10], alone.step([[3]])[0, 0, :10], rtol=0, atol=1e-5)
    ask(model, Request(15, [], [], end=True, want_state=True))


def test_a_tail_request_before_any_step_is_refused_and_starts_nothing_wrong(model):
    answer = model.execute([Request(16, [], [], start=True, raw={TAIL_INPUT: Tensor(TAIL_INPUT, np.array([[1]]))},
                                    outputs=TAILS)])[0]
    assert answer.error is not None and "no next-token distribution" in answer.error
    ask(model, Request(16, [5], [0]))  # the conversation's memory is empty, as a start's
    ok, = ask(model, tail_request(16, [1]))
    assert ok[TAIL_OUTPUT].shape == (1, 20) and np.isfinite(ok[TAIL_OUTPUT]).all()
    ask(model, Request(16, [], [], end=True, want_state=True))


def test_without_its_parts_the_model_answers_lazy_requests_from_full_distributions(tiny_onnx, tmp_path):
    from txl_deploy.serving.triton.repository import write_repository

    module = load_model_module()  # a stub of its own, whose log this test reads
    logged = []
    module.pb_utils.Logger = type("Logger", (), {"log_info": staticmethod(logged.append),
                                                 "log_warn": staticmethod(logged.append)})
    repo = write_repository(tiny_onnx, tmp_path / "repo", backend="python", max_batch=2, max_sequences=2)
    for part in (repo / "txl" / "1").glob("tiny.tail*.onnx"):
        part.unlink()  # the runtime refuses the parts: a tail is missing
    model = start_model(module, repo / "txl" / "1" / "tiny.onnx", tmp_path / "repo2", max_batch=2, max_sequences=2)
    assert not model.lazy and any("softmax parts are not at hand" in m and "not found" in m for m in logged)
    head, = ask(model, Request(1, [5, 6], [1], start=True, outputs=HEAD))
    tail, = ask(model, tail_request(1, [1, 2]))
    full, = ask(model, Request(1, [], [], end=True, want_state=True))
    assert model.counts == {"head": 0, "full": 1, "tails": [0, 0]}
    np.testing.assert_array_equal(tail[TAIL_OUTPUT][0], full["log_probs"][0, 0, 10:])
    np.testing.assert_array_equal(head[HEAD_OUTPUT][0, 0, :10], full["log_probs"][0, 0, :10])


def test_the_repository_carries_the_softmax_parts_beside_the_model(model, repo_dir, tiny_onnx):
    version = repo_dir / "txl" / "1"
    for name in ("tiny.head.onnx", "tiny.tail1.onnx", "tiny.tail2.onnx"):
        assert (version / name).read_bytes() == (tiny_onnx.parent / name).read_bytes()
