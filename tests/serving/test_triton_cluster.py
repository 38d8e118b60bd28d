"""Conversations that move between Triton servers, and a client routing over several servers.

Three real tritonserver processes on loopback (free ports), started once for the module and stopped at its end,
serve the Python-backend repository of the tiny model (`txl`) and of another model (`other`, other weights). Every
continuation is checked against the same conversation alone in an in-process TxlRuntime.
"""

from __future__ import annotations

import io
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers.conversations import alone

from txl_deploy.serving.triton.repository import write_repository


@pytest.fixture(scope="module")
def other_onnx(tmp_path_factory):
    """A second model of the same shape with other weights: its saved states must not load into the first."""
    from helpers.tiny import TINY_VOCAB, make_tiny_model

    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.vocab import Vocab

    base = tmp_path_factory.mktemp("other")
    save_checkpoint(base / "ckpt", make_tiny_model(seed=1), Vocab(TINY_VOCAB))
    export_onnx(base / "ckpt", base / "other.onnx", max_segment=16)
    return base / "other.onnx"


@pytest.fixture(scope="module")
def servers(tritonserver, tiny_onnx, other_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer

    base = tmp_path_factory.mktemp("cluster")
    repo = write_repository(tiny_onnx, base / "repo", backend="python", max_batch=4, max_sequences=16,
                            idle_timeout=120, threads=1)
    other = write_repository(other_onnx, base / "other", backend="python", name="other", max_batch=2,
                             max_sequences=4, idle_timeout=120, threads=1)
    shutil.move(str(other / "other"), str(repo / "other"))
    started = [TritonServer(repo) for _ in range(3)]
    try:
        with ThreadPoolExecutor(3) as pool:  # the servers start in parallel: most of the start is waiting
            list(pool.map(lambda s: s.start(), started))
        yield started
    finally:
        for srv in started:
            srv.__exit__(None, None, None)




def greedy(conv, n, prompt=None):
    """n greedy tokens of a conversation and the log-probs each was chosen from."""
    toks, lps = [], []
    for tok in conv.generate(prompt, max_new_tokens=n):
        lps.append(conv.last_log_probs.copy())
        toks.append(tok)
    return toks, lps


def test_python_repository_declares_park_and_resume_tensors_and_threads(tiny_onnx, tiny_onnx_full, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from txl_deploy.errors import ExportError

    repo = write_repository(tiny_onnx, tmp_path / "repo", backend="python", threads=2)
    cfg = text_format.Parse((repo / "txl" / "config.pbtxt").read_text(), mc.ModelConfig())
    inputs = {i.name: i for i in cfg.input}
    assert inputs["resume_state"].optional and inputs["resume_state"].data_type == mc.TYPE_UINT8
    assert not inputs["tokens"].optional
    assert {o.name: o.data_type for o in cfg.output}["saved_state"] == mc.TYPE_UINT8
    assert cfg.parameters["txl_deploy.threads"].string_value == "2"
    assert "client.drain(url)" in (repo / "README.md").read_text()
    with pytest.raises(ExportError, match="--threads must be an integer >= 1"):
        write_repository(tiny_onnx, tmp_path / "r2", backend="python", threads=0)
    from click.testing import CliRunner

    from txl_deploy.cli import main

    ok = CliRunner().invoke(main, ["triton-repo", str(tiny_onnx), "-o", str(tmp_path / "r3"), "--backend", "python",
                                   "--max-queue-delay-us", "5000", "--threads", "1"])
    assert ok.exit_code == 0, ok.output
    cfg = text_format.Parse((tmp_path / "r3" / "txl" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert cfg.sequence_batching.oldest.max_queue_delay_microseconds == 5000
    assert cfg.parameters["txl_deploy.threads"].string_value == "1"
    bad = CliRunner().invoke(main, ["triton-repo", str(tiny_onnx_full), "-o", str(tmp_path / "r4"), "--threads", "2"])
    assert bad.exit_code == 2 and "--threads applies to the python backend" in bad.output


# -- routing ---------------------------------------------------------------------------------------------------
def test_rendezvous_routing_is_balanced_and_moves_only_a_removed_servers_conversations():
    from txl_deploy.serving.triton.client import rendezvous_order

    urls = [f"grpc://10.0.0.{i}:8001" for i in range(4)]
    ids = range(1, 4001)
    first = {i: rendezvous_order(i, urls)[0] for i in ids}
    counts = {u: sum(1 for v in first.values() if v == u) for u in urls}
    assert min(counts.values()) > 850 and max(counts.values()) < 1150  # 1000 each, within 5 sigma
    without = {i: rendezvous_order(i, urls[1:])[0] for i in ids}
    for i in ids:
        if first[i] != urls[0]:
            assert without[i] == first[i]  # untouched
        else:
            assert without[i] == rendezvous_order(i, urls)[1]  # its second choice
    assert rendezvous_order(7, list(reversed(urls))) == rendezvous_order(7, urls)  # the list's order is irrelevant


# -- park, resume, move ----------------------------------------------------------------------------------------
def test_a_conversation_moved_to_another_server_continues_exactly(servers, reference):
    from txl_deploy.serving.triton.client import TxlTritonClient, parked_info

    a, b = TxlTritonClient(servers[0].grpc_url), TxlTritonClient(servers[1].http_url)
    prompt, n, k = [5, 17, 42, 3, 9, 11, 30, 2, 8, 1, 4, 44, 13, 50, 7, 6, 22, 19], 10, 4  # prompt: 2 pieces
    with a.conversation() as unmoved:
        want_toks, want_lps = greedy(unmoved, n, prompt)
    moving = a.conversation()
    toks, lps = greedy(moving, k, prompt)
    assert moving.pending is not None  # the last generated token has not been fed yet: park must carry it
    state = moving.park()
    assert moving.ended and a.server_of(moving.id) is None
    info = parked_info(state)
    assert info["sequence_id"] == moving.id and info["format_version"] == 1
    resumed = b.resume(state)
    assert resumed.id == moving.id and resumed.url == servers[1].http_url
    more_toks, more_lps = greedy(resumed, n - k)
    resumed.close()
    assert toks + more_toks == want_toks
    np.testing.assert_array_equal(np.stack(lps + more_lps), np.stack(want_lps))  # same arithmetic, same bits
    ref_toks, ref_lps = alone(reference, prompt, n)
    assert want_toks == ref_toks
    np.testing.assert_allclose(np.stack(want_lps), np.stack(ref_lps), rtol=0, atol=1e-5)
    # A moved conversation's old id is free on the first server: it ended there.
    from txl_deploy.serving.triton.client import ServingError

    with pytest.raises(ServingError, match=f"does not know conversation {moving.id}"):
        a.infer(moving.id, [1], [0])
    a.close()
    b.close()


def test_a_parked_conversation_resumes_in_process_too(servers, reference):
    from txl_deploy.serving.triton.client import TxlTritonClient

    client = TxlTritonClient(servers[2].grpc_url)
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 6
    conv = client.conversation()
    toks, _ = greedy(conv, 2, prompt)
    state = conv.park()
    rt = reference()
    with np.load(io.BytesIO(state), allow_pickle=False) as z:
        rt.load_state({k: z[k] for k in z.files})
    rest = list(rt.generate(max_new_tokens=n - 2, temperature=0))
    assert toks + rest == alone(reference, prompt, n)[0]
    client.close()


def test_a_state_from_another_model_or_garbage_is_refused(servers):
    from txl_deploy.serving.triton.client import ServingError, TxlTritonClient

    txl, other = TxlTritonClient(servers[0].grpc_url), TxlTritonClient(servers[1].grpc_url, model="other")
    conv = txl.conversation()
    conv.feed([1, 2, 3])
    state = conv.park()
    with pytest.raises(ServingError, match="saved from another model"):
        other.resume(state)
    with pytest.raises(ServingError, match="not a saved conversation state"):
        txl.resume(b"not an npz file", sequence_id=77)
    # nothing started on a refusal, and the right model still takes the state
    with pytest.raises(ServingError, match="does not know conversation"):
        other.infer(conv.id, [1], [0])
    again = txl.resume(state)
    again.feed([4])
    again.close()
    txl.close()
    other.close()


# -- several servers -------------------------------------------------------------------------------------------
def _ids_spread(urls, per_server, start):
    """Sequence ids whose rendezvous choice puts `per_server` conversations on each server (random ids could leave
    a server empty and the test without its subject)."""
    from txl_deploy.serving.triton.client import rendezvous_order

    picked, counts, i = [], {u: 0 for u in urls}, start
    while len(picked) < per_server * len(urls):
        best = rendezvous_order(i, urls)[0]
        if counts[best] < per_server:
            counts[best] += 1
            picked.append(i)
        i += 1
    return picked


def _prompts(count, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 60, size=int(rng.integers(2, 20))).tolist() for _ in range(count)]


def test_draining_a_server_mid_run_moves_its_conversations_and_every_one_continues(servers, reference):
    from txl_deploy.serving.triton.client import TxlTritonClient

    urls = [s.grpc_url for s in servers]
    client = TxlTritonClient(urls)  # one client shared by the threads (gRPC)
    count, n, k = 12, 8, 3
    prompts = _prompts(count, seed=1)
    before, after = threading.Barrier(count + 1), threading.Barrier(count + 1)
    convs = [client.conversation(i) for i in _ids_spread(urls, count // 3, start=1000)]

    def run(i):
        conv = convs[i]
        toks, lps = greedy(conv, k, prompts[i])
        before.wait(timeout=60)
        after.wait(timeout=60)  # the drain runs between these
        more = greedy(conv, n - k)
        conv.close()
        return toks + more[0], lps + more[1]

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(run, i) for i in range(count)]
        before.wait(timeout=60)
        on_first = [c.id for c in convs if c.url == urls[0]]
        assert len(on_first) == count // 3
        moved = client.drain(urls[0])
        where = {c.id: c.url for c in convs}
        after.wait(timeout=60)
        results = [f.result(timeout=120) for f in futures]
    assert moved == len(on_first)
    assert urls[0] not in where.values()
    assert all(where[cid] == client.route(cid) for cid in on_first)  # each went to its next server by hashing
    for prompt, (toks, lps) in zip(prompts, results):
        want_toks, want_lps = alone(reference, prompt, n)
        assert toks == want_toks
        np.testing.assert_allclose(np.stack(lps), np.stack(want_lps), rtol=0, atol=1e-5)
    # a drained server gets no new conversations
    assert all(client.route(i) != urls[0] for i in range(1, 200))
    client.undrain(urls[0])
    client.close()


def test_a_killed_server_fails_only_its_conversations_each_with_a_clear_error(servers, reference):
    """Runs last: it kills the third server (the module's teardown stops the rest)."""
    from txl_deploy.serving.triton.client import ServingError, TxlTritonClient

    urls = [s.grpc_url for s in servers]
    client = TxlTritonClient(urls, timeout=20)
    prompts = _prompts(9, seed=2)
    convs = [client.conversation(i) for i in _ids_spread(urls, 3, start=5000)]
    first = [c.feed(p) for c, p in zip(convs, prompts)]
    lost = [c for c in convs if c.url == urls[2]]
    kept = [(c, p, lp) for c, p, lp in zip(convs, prompts, first) if c.url != urls[2]]
    assert len(lost) == 3 and len(kept) == 6
    servers[2].stop(kill=True)
    for conv in lost:
        with pytest.raises(ServingError) as err:
            conv.feed([1])
        message = str(err.value)
        assert urls[2] in message and f"conversation {conv.id}" in message and "memory is lost" in message
    for conv, prompt, lp in kept:
        tok = int(np.argmax(lp))
        got = conv.feed([tok])
        _, want = alone(reference, prompt, 2)
        np.testing.assert_allclose(np.stack([lp, got]), np.stack(want), rtol=0, atol=1e-5)
        conv.close()
    # new conversations go to the servers that are left
    with client.conversation() as fresh:
        fresh.feed([1, 2])
        assert fresh.url in urls[:2]
    client.close()
    # a client started while a server is down still serves, from the others
    later = TxlTritonClient(urls, timeout=20)
    assert later.servers[urls[2]].lost_at is not None
    for i in _ids_spread(urls, 2, start=9000):
        with later.conversation(i) as conv:
            conv.feed([3, 4])
            assert conv.url != urls[2]
    later.close()
