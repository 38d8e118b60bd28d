"""TxlRuntime's public settings and generate(): thread counts per backend, arguments checked before the memory is
touched, and a lock that is never held while a generator is suspended."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from helpers.cli import cli
from helpers.streams import assert_state_equal

from txl_deploy.errors import InputError, TxlError
from txl_deploy.runtimes import TxlRuntime


@pytest.fixture
def torch_threads():
    """Put torch's process-wide thread count back after a test that sets it."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _state(rt):
    return {k: np.array(v, copy=True) for k, v in rt.save_state().items()}


def _finishes(fn, timeout=30.0):
    """Run fn in another thread; True if it returned within `timeout` (a blocked lock means it did not)."""
    done = threading.Event()

    def target():
        fn()
        done.set()

    threading.Thread(target=target, daemon=True).start()
    return done.wait(timeout)


# -- threads --------------------------------------------------------------------------------------------------
def test_threads_set_onnxruntime_intra_op_and_one_inter_op_thread(tiny_onnx):
    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        opts = rt.backend.session.get_session_options()
        assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == (1, 1)
        assert rt.threads == 1
    with TxlRuntime.load(tiny_onnx, threads=3) as rt:
        assert rt.backend.session.get_session_options().intra_op_num_threads == 3
    with TxlRuntime.load(tiny_onnx) as rt:  # default: ONNX Runtime's own choice (0 = one per core)
        assert rt.backend.session.get_session_options().intra_op_num_threads == 0 and rt.threads is None


@pytest.mark.parametrize("backend", ["torch", "torch-fast"])
def test_threads_set_torch_threads_for_the_pytorch_backends(tiny_ckpt, backend, torch_threads):
    import torch

    torch.set_num_threads(2)
    with TxlRuntime.load(tiny_ckpt, backend=backend, threads=1) as rt:
        assert torch.get_num_threads() == 1 and rt.threads == 1
        rt.step([[1, 2, 3]])
    with TxlRuntime.load(tiny_ckpt, backend=backend):
        assert torch.get_num_threads() == 1  # without threads=, the process's setting is left alone


def test_threads_with_the_same_setting_give_the_same_numbers(tiny_onnx, ort_rt):
    tokens = np.arange(30).reshape(1, 30) % 60
    ort_rt.reset()
    want = ort_rt.step(tokens)
    ort_rt.reset()
    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        np.testing.assert_allclose(rt.step(tokens), want, atol=1e-5)


def test_tensorrt_says_threads_do_not_apply(tmp_path):
    """TensorRT runs on the GPU: threads= is not silently dropped, a warning says it has no effect."""
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"not an engine")
    with pytest.warns(RuntimeWarning, match="no effect on the TensorRT backend"):
        with pytest.raises(TxlError):  # no TensorRT (or no GPU) here: loading fails after the warning
            TxlRuntime.load(engine, threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # without threads=, nothing to warn about
        with pytest.raises(TxlError):
            TxlRuntime.load(engine)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True])
def test_bad_thread_counts_are_refused(tiny_onnx, bad):
    with pytest.raises(InputError, match="threads must be a whole number >= 1"):
        TxlRuntime.load(tiny_onnx, threads=bad)


@pytest.mark.parametrize("command", ["generate", "eval", "export", "verify", "demo", "bench"])
def test_every_command_that_runs_a_model_takes_threads(command):
    r = cli(command, "--help")
    assert r.exit_code == 0
    assert "--threads" in r.output and "intra-op" in r.output and "TensorRT" in r.output


def test_cli_threads_reach_the_runtime(tiny_ckpt, tiny_onnx, tmp_path, monkeypatch, torch_threads):
    seen = []
    load = TxlRuntime.load.__func__

    def spy(cls, path, *a, **k):
        seen.append(k.get("threads"))
        return load(cls, path, *a, **k)

    monkeypatch.setattr(TxlRuntime, "load", classmethod(spy))
    r = cli("generate", tiny_onnx, "--prompt", "w1", "--max-new-tokens", 2, "--threads", 1)
    assert r.exit_code == 0, r.output
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(40)))
    r = cli("eval", tiny_onnx, "--text", text, "--threads", 1)
    assert r.exit_code == 0, r.output
    out = tmp_path / "m.onnx"
    r = cli("export", tiny_ckpt, "-o", out, "--max-segment", 16, "--threads", 1)
    assert r.exit_code == 0, r.output
    r = cli("verify", out, "--against", tiny_ckpt, "--threads", 1)
    assert r.exit_code == 0, r.output
    assert seen == [1, 1, 1, 1]  # generate, eval, export's verification, verify


# -- generate(): checked before the memory is touched --------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[[1, 2], [3, 4]]), "generate\\(\\) runs one stream, but the prompt has 2 rows"),
    (dict(prompt=[1, 2, 60]), "token id 60 is outside the vocabulary"),
    (dict(prompt=[1.5, 2.0]), "must be integers"),
    (dict(prompt=[[[1]]]), "the prompt must be text or token ids"),
    (dict(prompt=[1], temperature=-1), "temperature must be a finite number >= 0"),
    (dict(prompt=[1], temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(prompt=[1], top_k=0), "top_k must be a whole number >= 1"),
    (dict(prompt=[1], top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(prompt=[1], max_new_tokens=-1), "max_new_tokens must be a whole number >= 0"),
    (dict(prompt=[1], max_new_tokens=2.5), "max_new_tokens must be a whole number >= 0"),
    (dict(prompt=[1], seed=-3), "seed must be a whole number >= 0"),
    (dict(prompt=[1], stop=["x"]), "stop token id must be a whole number"),
])
def test_rejected_generate_leaves_the_memory_unchanged(ort_rt, kwargs, message):
    ort_rt.reset()
    ort_rt.step([[5, 6, 7]])
    before, last = _state(ort_rt), ort_rt._last_log_probs.copy()
    with pytest.raises(InputError, match=message):
        ort_rt.generate(**kwargs)  # raised by the call itself, before any token is asked for
    assert_state_equal(_state(ort_rt), before)
    np.testing.assert_array_equal(ort_rt._last_log_probs, last)
    ort_rt.reset()


def test_batch_two_prompt_into_an_empty_runtime_creates_no_memory(ort_rt):
    ort_rt.reset()
    with pytest.raises(InputError, match="runs one stream"):
        ort_rt.generate([[1, 2, 3], [4, 5, 6]], max_new_tokens=3)
    assert ort_rt.batch_size is None  # nothing was prefilled
    ort_rt.step([[1, 2], [3, 4]])  # a later call may still choose any batch size
    ort_rt.reset()


def test_generate_against_a_multi_row_memory_is_refused_untouched(ort_rt):
    ort_rt.reset()
    ort_rt.step([[1, 2], [3, 4]])
    before = _state(ort_rt)
    with pytest.raises(InputError, match="batch size 1 does not match the runtime's memory \\(2 rows\\)"):
        ort_rt.generate([7, 8])
    with pytest.raises(InputError, match="the memory holds 2 rows"):
        ort_rt.generate(None)
    assert_state_equal(_state(ort_rt), before)
    ort_rt.reset()


def test_continuing_needs_a_fed_stream(ort_rt):
    ort_rt.reset()
    with pytest.raises(InputError, match="needs a prompt"):
        ort_rt.generate()
    ort_rt.step([[1, 2]])
    ort_rt.reset(rows=[0])  # the row's memory is gone: there is nothing to continue from
    with pytest.raises(InputError, match="reset since its last call"):
        ort_rt.generate()
    ort_rt.reset()


def test_generate_feeds_its_tokens_and_continues(ort_rt):
    """Arguments are checked at the call, the work happens on iteration: the numbers are those of step()."""
    ort_rt.reset()
    gen = ort_rt.generate([1, 2, 3], max_new_tokens=4, temperature=0)
    assert ort_rt.batch_size is None  # the prompt is fed when the first token is asked for
    toks = list(gen)
    after = _state(ort_rt)
    ort_rt.reset()
    lp = ort_rt.step([[1, 2, 3]])[0, -1]
    want = []
    for _ in range(4):
        want.append(int(np.argmax(lp)))
        lp = ort_rt.step([[want[-1]]])[0, -1]
    assert toks == want
    # Every generated token was fed: the memory is step()'s bit for bit. On an adaptive softmax the lazy path
    # composes its last distribution from the head and tail graphs, whose numbers can differ from the full graph's
    # in the last bit (float32 rounding), so that one array is compared within it.
    want_state = _state(ort_rt)
    last = "__last_log_probs__"
    np.testing.assert_allclose(after.pop(last), want_state.pop(last), rtol=0, atol=1e-5)
    assert_state_equal(after, want_state)
    more = list(ort_rt.generate(max_new_tokens=2, temperature=0))  # no prompt: continues the memory
    assert more[0] == int(np.argmax(lp))
    ort_rt.reset()


# -- generate(): the lock is held per step, not across yield --------------------------------------------------
def test_suspended_generator_does_not_block_other_callers(ort_rt):
    ort_rt.reset()
    gen = ort_rt.generate([1, 2, 3], max_new_tokens=10, temperature=0)
    next(gen)  # suspended at its first yield
    out = []
    assert _finishes(lambda: out.append(ort_rt.step([[4]]))), "step() blocked while a generator was suspended"
    assert out[0].shape == (1, 1, 60)
    next(gen)  # and the generator goes on, over the memory the other call advanced
    del gen  # abandoned half-way
    assert _finishes(ort_rt.reset)
    ort_rt.reset()


def test_generator_driven_from_another_thread_does_not_block(ort_rt):
    ort_rt.reset()
    gen = ort_rt.generate([1, 2, 3], max_new_tokens=10, temperature=0)
    got = []
    assert _finishes(lambda: got.append(next(gen)))  # that thread ends with the generator suspended
    assert got
    assert _finishes(lambda: ort_rt.step([[5]])), "a generator advanced in another thread kept the lock"
    assert _finishes(lambda: ort_rt.save_state())
    gen.close()
    ort_rt.reset()
