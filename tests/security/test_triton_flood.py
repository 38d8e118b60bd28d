"""A flood of bad requests through a real tritonserver (the Python backend, as `triton-repo --backend python` writes
it) leaves the good conversations' outputs identical to a run without the flood, and costs the model no memory:
state bombs, damaged and foreign states, oversized and out-of-vocabulary segments are all refused.

The server is the one the nvidia-pytriton wheel bundles (see tests/test_triton.py); without it this is skipped.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as th
from crafted_files import Member, deflated_zeros, npy_header, state_zip
from tritonclient.utils import InferenceServerException

from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.triton.repository import write_repository

PROMPTS = [[5, 17, 42, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [33]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def server(tritonserver, tiny_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer

    repo = write_repository(tiny_onnx, tmp_path_factory.mktemp("flood") / "repo", backend="python", max_batch=4,
                            max_sequences=16, idle_timeout=120)
    with TritonServer(repo) as srv:
        yield srv


def good_conversations(url):
    """Each prompt, then greedy tokens, one conversation after another: (tokens, log-probs) per conversation."""
    from txl_deploy.serving.triton.client import TxlTritonClient

    client = TxlTritonClient(url, timeout=120)
    results = []
    for prompt in PROMPTS:
        with client.conversation() as conv:
            lps, toks = [conv.feed(prompt)], []
            for _ in range(NEW_TOKENS):
                toks.append(int(np.argmax(lps[-1])))
                lps.append(conv.feed([toks[-1]]))
        results.append((toks, np.stack(lps)))
    client.close()
    return results


def bad_requests(tiny_onnx):
    """(what, inputs) of requests that must each be refused: (name, dtype, array) triples."""
    with TxlRuntime.load(tiny_onnx) as rt:
        rt.step([[1, 2, 3]])
        state = rt.save_state()
    state.update({"__format__": np.array("txl-deploy conversation state"), "__format_version__": np.array(1)})
    good = state_zip(state)
    shape = (1 << 17,) + state["mem_k.0"].shape[1:]
    header = npy_header(shape)
    # 1 MB that expands to 1 GiB (refused by its size), and 64 KB whose header claims 1 GiB (by its header)
    large_bomb = state_zip(state, **{"mem_k.0": Member("mem_k.0.npy", b"", 8, declared_size=len(header) + 2**30,
                                                       compressed=deflated_zeros(2**30))})
    small_bomb = state_zip(state, **{"mem_k.0": Member("mem_k.0.npy", b"", 8, declared_size=len(header) + 2**30,
                                                       compressed=deflated_zeros(2**26))})
    foreign = state_zip({**state, "__fingerprint__": np.array("kv-0000000000000000-float32")})
    tok = lambda *t: ("tokens", "INT64", np.array([t], np.int64))  # noqa: E731
    pos = lambda *p: ("out_positions", "INT64", np.array([p], np.int64))  # noqa: E731
    resume = lambda blob: ("resume_state", "UINT8", np.frombuffer(blob, np.uint8)[None])  # noqa: E731
    empty = [("tokens", "INT64", np.zeros((1, 0), np.int64)), ("out_positions", "INT64", np.zeros((1, 0), np.int64))]
    return {
        "large bomb": empty + [resume(large_bomb)],
        "small bomb": empty + [resume(small_bomb)],
        "damaged state": empty + [resume(good[: len(good) // 2])],
        "flipped state": empty + [resume(good[:300] + bytes([good[300] ^ 0xFF]) + good[301:])],
        "foreign state": empty + [resume(foreign)],
        "garbage state": empty + [resume(os.urandom(4096))],
        "long segment": [("tokens", "INT64", np.zeros((1, 5000), np.int64)), pos(0)],
        "many positions": [tok(1), ("out_positions", "INT64", np.zeros((1, 5000), np.int64))],
        "outside the vocabulary": [tok(1, 60), pos(1)],
        "negative token": [tok(-7), pos(0)],
        "position outside the segment": [tok(1, 2), pos(2)],
    }


def stub_peak_rss(server) -> int:
    """Bytes: the largest peak resident size (VmHWM) among the server's Python-backend stub processes."""
    peaks = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != server.process.pid:
                continue
            with open(f"/proc/{pid}/status") as f:
                peaks += [int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")]
        except (OSError, ValueError, IndexError):
            continue
    assert peaks, "no Python-backend stub process found"
    return max(peaks)


def test_a_flood_of_bad_requests_changes_no_good_conversation(server, tiny_onnx):
    quiet = good_conversations(server.http_url)
    # the reference: each conversation alone in this process
    for prompt, (toks, lps) in zip(PROMPTS, quiet):
        with TxlRuntime.load(tiny_onnx) as rt:
            want = [rt.prefill([prompt])[0]]
            for t in toks:
                want.append(rt.prefill([[t]])[0])
        np.testing.assert_allclose(lps, np.stack(want), rtol=0, atol=1e-5)

    cases = bad_requests(tiny_onnx)
    hwm_before = stub_peak_rss(server)
    done = threading.Event()
    sent = {what: 0 for what in cases}
    errors = []
    ids = iter(range(10**9, 2 * 10**9))
    lock = threading.Lock()

    def flood(worker):
        client = th.InferenceServerClient(server.http_url[len("http://"):], network_timeout=120)
        names = list(cases)
        i = worker
        while not done.is_set():
            what = names[i % len(names)]
            i += 1
            inputs = []
            for name, dtype, array in cases[what]:
                inp = th.InferInput(name, list(array.shape), dtype)
                inp.set_data_from_numpy(array)
                inputs.append(inp)
            with lock:
                sid = next(ids)
            try:
                # START and END together: a refused start also leaves Triton's sequence slot free
                client.infer("txl", inputs, sequence_id=sid, sequence_start=True, sequence_end=True)
                errors.append(f"{what}: answered")
            except InferenceServerException as e:
                if "txl-deploy" not in str(e):
                    errors.append(f"{what}: {str(e)[:200]}")
            with lock:
                sent[what] += 1
        client.close()

    def every_case_sent(times, deadline):
        end = time.monotonic() + deadline
        while time.monotonic() < end and not all(f.done() for f in floods):  # a flood that died ends the wait
            with lock:
                if min(sent.values()) >= times:
                    return
            time.sleep(0.05)

    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood, w) for w in range(4)]
        every_case_sent(1, 120)  # the flood is under way before the good conversations start
        try:
            busy = good_conversations(server.http_url)
            every_case_sent(2, 120)  # and every bad case came at least twice
        finally:
            done.set()
        for f in floods:
            f.result(timeout=120)
    assert not errors, errors[:5]
    assert all(n >= 2 for n in sent.values()), sent
    for (toks, lps), (toks_quiet, lps_quiet) in zip(busy, quiet):
        assert toks == toks_quiet
        np.testing.assert_array_equal(lps, lps_quiet)
    # no request made the model allocate what it claimed (a bomb would have added 1 GiB)
    assert stub_peak_rss(server) - hwm_before < 64 << 20
    assert server.ready()
