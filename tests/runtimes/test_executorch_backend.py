"""TxlRuntime on the tiny model's ExecuTorch program (`.pte`): the whole backend contract against the ONNX Runtime
backend and the eager PyTorch reference: a multi-segment batch-2 stream that wraps the ring buffer, greedy
generation, scoring, positions without advancing, rows reset alone, saved states (also across backends), bad
input and a failing program call leaving the memory untouched, the process-wide thread pool, and `eval` and `generate`
on the command line.

Tolerance: fp32 log-probabilities within 1e-4 max abs difference of the reference (observed ~2e-6).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.streams import assert_reset_rows_restarts_only_those_rows, assert_state_equal, one_pass, stream

from txl_deploy.errors import InputError, install_hint
from txl_deploy.runtimes import TxlRuntime

pytest.importorskip("executorch", reason="pip install 'txl-deploy[executorch]'")

TOL = 1e-4


@pytest.fixture(scope="module")
def pte_rt(tiny_pte):
    # ExecuTorch's default pool: resizing it is the threads test's, in a process of its own
    with TxlRuntime.load(tiny_pte) as rt:
        yield rt


def _pieces(tokens, cuts):
    bounds = [0, *cuts, tokens.shape[1]]
    return [tokens[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# -- feeding --------------------------------------------------------------------------------------------------
def test_a_stream_that_wraps_the_ring_matches_onnxruntime_and_the_reference(pte_rt, ort_rt, ref_rt):
    """Batch 2, 46 tokens through a 12-slot memory in pieces of 1 to 16 tokens (the ring wraps several times)."""
    assert pte_rt.backend.name == "executorch" and pte_rt.mem_len == 12
    tokens = np.random.default_rng(11).integers(0, 60, (2, 46))
    pieces = _pieces(tokens, [5, 6, 19, 20, 33, 40])
    got = stream(pte_rt, pieces)
    np.testing.assert_allclose(got, stream(ref_rt, pieces), atol=TOL, rtol=0)
    np.testing.assert_allclose(got, stream(ort_rt, pieces), atol=TOL, rtol=0)
    # one call longer than max_segment (16) is fed in pieces with the same result
    np.testing.assert_allclose(one_pass(pte_rt, tokens), one_pass(ref_rt, tokens), atol=TOL, rtol=0)


def test_positions_without_advancing_repeat_and_match_a_full_step(pte_rt):
    tokens = np.random.default_rng(12).integers(0, 60, (2, 9))
    pte_rt.reset()
    pte_rt.step(tokens[:, :7])
    before = pte_rt.save_state()
    a = pte_rt.step(tokens[:, 7:], positions=[0], advance=False)
    b = pte_rt.step(tokens[:, 7:], positions=[1], advance=False)
    assert_state_equal(pte_rt.save_state(), before)
    full = pte_rt.step(tokens[:, 7:])
    np.testing.assert_array_equal(np.concatenate([a, b], axis=1), full)
    pte_rt.reset()


# -- generation and scoring -----------------------------------------------------------------------------------
def test_greedy_200_tokens_identical_to_onnxruntime(pte_rt, ort_rt):
    for rt in (pte_rt, ort_rt):
        rt.reset()
    got = list(pte_rt.generate("w1 w2 w3", max_new_tokens=200, temperature=0))
    ref = list(ort_rt.generate("w1 w2 w3", max_new_tokens=200, temperature=0))
    for rt in (pte_rt, ort_rt):
        rt.reset()
    assert len(got) == 200 and got == ref


def test_seeded_sampling_matches_onnxruntime(pte_rt, ort_rt):
    runs = []
    for rt in (pte_rt, ort_rt):
        rt.reset()
        runs.append(list(rt.generate("w5", max_new_tokens=40, temperature=1.0, top_k=20, seed=3)))
        rt.reset()
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_score_matches_the_reference(pte_rt, ref_rt):
    tokens = np.random.default_rng(13).integers(0, 60, (2, 30))
    for rt in (pte_rt, ref_rt):
        rt.reset()
    got, ref = pte_rt.score(tokens), ref_rt.score(tokens)
    for rt in (pte_rt, ref_rt):
        rt.reset()
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


# -- state ----------------------------------------------------------------------------------------------------
def test_reset_rows_restarts_only_those_rows(pte_rt):
    assert_reset_rows_restarts_only_those_rows(pte_rt, seed=14, atol=TOL)


def test_save_and_load_state_resumes_and_crosses_to_onnxruntime(pte_rt, ort_rt, tmp_path):
    """The .pte and the .onnx of one checkpoint share the memory layout: a state saved by one resumes on the
    other."""
    tokens = np.random.default_rng(15).integers(0, 60, (2, 30))
    pte_rt.reset()
    pte_rt.step(tokens[:, :20])
    pte_rt.save_state(tmp_path / "conv.npz")
    expect = pte_rt.step(tokens[:, 20:])
    pte_rt.reset()
    pte_rt.step(tokens[:, :5])  # something else in between
    pte_rt.load_state(tmp_path / "conv.npz")
    np.testing.assert_array_equal(pte_rt.step(tokens[:, 20:]), expect)
    ort_rt.reset()
    ort_rt.load_state(tmp_path / "conv.npz")
    np.testing.assert_allclose(ort_rt.step(tokens[:, 20:]), expect, atol=TOL, rtol=0)
    pte_rt.load_state(ort_rt.save_state())
    np.testing.assert_allclose(pte_rt.step(tokens[:, :3]), ort_rt.step(tokens[:, :3]), atol=TOL, rtol=0)
    pte_rt.reset()
    ort_rt.reset()


# -- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, message", [
    ([[1, 2, 60]], "token id 60 is outside the vocabulary"),
    ([1, 2, 3], "rank 1"),
    ([[1, 2], [3, 4], [5, 6]], "batch size 3 does not match"),
])
def test_bad_tokens_are_rejected_and_the_memory_is_untouched(pte_rt, tokens, message):
    pte_rt.reset()
    pte_rt.step([[1, 2], [3, 4]])
    before = pte_rt.save_state()
    with pytest.raises(InputError, match=message):
        pte_rt.step(tokens)
    assert_state_equal(pte_rt.save_state(), before)
    pte_rt.reset()


def test_a_call_the_program_refuses_leaves_the_memory_untouched(pte_rt):
    """A segment longer than the program's bound, given to the backend directly (the runtime would have split it):
    ExecuTorch fails inside the call, the error is one line, and nothing was written to the memory."""
    pte_rt.reset()
    pte_rt.step([[1, 2], [3, 4]])
    before = pte_rt.save_state()
    backend = pte_rt.backend
    too_long = np.ones((2, backend.max_segment + 1), np.int64)
    with pytest.raises(InputError, match="ExecuTorch program refused") as e:
        backend.run(pte_rt._state, too_long, np.zeros((2, 1), np.int64))
    assert "\n" not in str(e.value)
    assert_state_equal(pte_rt.save_state(), before)
    pte_rt.reset()


def test_more_rows_than_the_program_was_exported_for_are_refused(pte_rt):
    pte_rt.reset()
    rows = pte_rt.backend.max_batch + 1
    with pytest.raises(InputError, match=f"at most {rows - 1} rows"):
        pte_rt.step(np.ones((rows, 1), np.int64))
    assert pte_rt.batch_size is None


# -- threads --------------------------------------------------------------------------------------------------
def test_threads_size_the_process_wide_pool_only_while_no_other_program_is_open(tiny_pte):
    """In a fresh process: threads=2 sizes ExecuTorch's pool; a second runtime asking for 1 while the first is open
    keeps the pool (resizing it under a loaded program crashes that program) and says so; both still run segments
    of new shapes and agree."""
    code = textwrap.dedent(f"""
        import warnings
        import numpy as np
        from executorch.extension.pybindings import portable_lib
        from txl_deploy import TxlRuntime
        first = TxlRuntime.load({str(tiny_pte)!r}, threads=2)
        assert first.threads == 2 and portable_lib._threadpool_get_thread_count() == 2
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            second = TxlRuntime.load({str(tiny_pte)!r}, threads=1)
        assert len(seen) == 1 and issubclass(seen[0].category, RuntimeWarning), seen
        assert "threads=1 is not applied" in str(seen[0].message), seen[0].message
        assert second.threads == 2 and portable_lib._threadpool_get_thread_count() == 2
        tokens = np.random.default_rng(0).integers(0, 60, (2, 20))
        for a, b in ((0, 5), (5, 6), (6, 19), (19, 20)):
            np.testing.assert_array_equal(first.step(tokens[:, a:b]), second.step(tokens[:, a:b]))
        first.close()
        second.close()
        third = TxlRuntime.load({str(tiny_pte)!r}, threads=1)  # nothing else open: the pool is resized
        assert third.threads == 1 and portable_lib._threadpool_get_thread_count() == 1
        third.step(tokens[:, :3]), third.step(tokens[:, 3:4])
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_bad_thread_counts_are_refused(tiny_pte):
    with pytest.raises(InputError, match="threads must be a whole number"):
        TxlRuntime.load(tiny_pte, threads=0)


# -- without ExecuTorch ---------------------------------------------------------------------------------------
def test_without_executorch_loading_a_pte_says_which_extra(tiny_pte):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["executorch"] = None  # as if the executorch extra were not installed
        from txl_deploy import TxlRuntime
        from txl_deploy.errors import InputError
        try:
            TxlRuntime.load({str(tiny_pte)!r})
        except InputError as e:
            print(e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert install_hint("executorch") in r.stdout and r.stdout.count("\n") == 1, r.stdout


# -- command line ---------------------------------------------------------------------------------------------
def test_eval_and_generate_run_a_pte(tiny_pte, tiny_onnx, tmp_path):
    import json

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(200)) + "\n")
    scores = {}
    for model in (tiny_pte, tiny_onnx):
        out = tmp_path / f"{model.suffix[1:]}.json"
        r = cli("eval", model, "--text", text, "--threads", 1, "--json", out)
        assert r.exit_code == 0, r.output
        scores[model.suffix] = json.loads(out.read_text())
    assert scores[".pte"]["backend"] == "executorch"
    assert scores[".pte"]["n_tokens"] == scores[".onnx"]["n_tokens"] == 200  # 200 words and the line's <eos>: 200 predicted
    assert scores[".pte"]["perplexity"] == pytest.approx(scores[".onnx"]["perplexity"], rel=1e-5)

    # sampled with a seed: every token depends on the model's distribution at its step (greedy repeats one word)
    r, r_onnx = (cli("generate", model, "--prompt", "w1 w2", "--max-new-tokens", 10, "--seed", 5)
                 for model in (tiny_pte, tiny_onnx))
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("w1 w2 ") and len(r.stdout.split()) > 6 and r.stdout == r_onnx.stdout


def test_a_pte_without_its_sidecar_is_a_one_line_error(tiny_pte, tmp_path):
    lone = tmp_path / "lone.pte"
    lone.write_bytes(tiny_pte.read_bytes())
    assert_one_line_error(cli("generate", lone, "--prompt", "w1", "--max-new-tokens", 2), "lone.pte", "sidecar")


def test_bench_measures_a_pte(tiny_pte, tmp_path):
    import json

    out = tmp_path / "bench.json"
    r = cli("bench", tiny_pte, "--baseline", "none", "--gen-len", 4, "--prompt-len", 4, "--repeat", 1,
            "--warmup", 0, "--quiet", "--json", out)
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["settings"]["backend"] == "executorch"
    assert "executorch" in r.stdout


def test_generate_from_a_pte_prints_only_the_text_and_imports_no_compiler(tiny_pte):
    """Running a program needs ExecuTorch's runtime only: not its compiler (exir) nor torchao, whose imports print
    lines of their own; the C++ runtime's cpuinfo lines (file descriptor 2) show with -v only."""
    code = textwrap.dedent(f"""
        import sys
        from txl_deploy.cli.main import main
        verbose = sys.argv[1:] == ["-v"]
        try:
            main([*sys.argv[1:], "generate", {str(tiny_pte)!r}, "--prompt", "w1", "--max-new-tokens", "3",
                  "--seed", "1"])
        except SystemExit as e:
            assert not e.code, e.code
        print("imported:", sorted(m for m in ("torchao", "executorch.exir") if m in sys.modules))
    """)
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stdout.startswith("w1 ") and quiet.stdout.splitlines()[-1] == "imported: []", quiet.stdout
    assert quiet.stderr == "", quiet.stderr
    verbose = subprocess.run([sys.executable, "-c", code, "-v"], capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert verbose.stdout.startswith("w1 "), verbose.stdout
