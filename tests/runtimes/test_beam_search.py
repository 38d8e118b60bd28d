"""Beam search (`TxlRuntime.beam_search`) decodes as HuggingFace's `generate(num_beams=k, do_sample=False)`.

The oracle is HF's own `_beam_search` (transformers 4.56) on its TransfoXL (helpers/hf_beam_search.py says the two
shims 4.56 needs to drive it), a random model with an adaptive softmax (two tail clusters) and a 7-slot memory
that the prompts and beams wrap. The same HF folder is converted and run on ONNX Runtime (lazy tails and full
distributions), PyTorch eager and torch-fast, from HF's first memory (mem_len zeros, `start_from_zero_memory`).
Every case must give HF's sequences, in HF's order, and HF's `sequences_scores` to 1e-5 + 1e-6 relative (float32
sums of up to a dozen log-probs, some near -120, where backends differ by up to 4e-5: 3e-7 relative, a few ulp).
The cases cover the three early_stopping modes, positive, zero and negative length penalties, no, one and two stop
ids, and num_return_sequences from 1 to num_beams.

ExecuTorch (its export takes minutes) runs on the shared tiny program: it must return what the eager reference
returns on the tiny checkpoint, to the same tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.beam_search import best_first

torch = pytest.importorskip("torch")

from helpers.hf_beam_search import hf_beams  # noqa: E402
from helpers.reference_models import build_hf, write_vocab_txt  # noqa: E402

from benchmarks.peer_huggingface import with_generate  # noqa: E402

TOL, RTOL = 1e-5, 1e-6  # scores: float32 sums of up to a dozen log-probs, as large as -120
# (num_beams, max_new_tokens, length_penalty, early_stopping, num_return_sequences, stop, prompt)
CASES = [
    (3, 6, 1.0, False, 3, [2], [3, 17, 5, 22]),
    (4, 9, 0.0, "never", 2, None, [1, 9]),
    (2, 7, 2.0, True, 2, [8, 0], [3, 17, 5]),
    (4, 12, -1.0, False, 4, 0, [5]),
    (3, 10, 1.5, "never", 3, [0], [3, 4, 5, 6, 7]),
    (4, 10, 1.0, True, 1, [0], [7, 7]),
]
HF_BACKENDS = [("onnxruntime", True), ("onnxruntime", False), ("torch", True), ("torch-fast", True)]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """HF's random TransfoXL saved as an HF folder, and the model object itself (without the fixture's patch)."""
    from transformers.models.deprecated import transfo_xl as transfo  # heavy: only the oracle tests load it

    folder = tmp_path_factory.mktemp("hf-beams") / "hf"
    model = build_hf(transfo, untie_r=True, same_length=True)
    model.save_pretrained(folder)
    write_vocab_txt(folder)
    return folder, with_generate(model)


@pytest.fixture(scope="module")
def hf_onnx(hf_folder):
    from txl_deploy.exporters.onnx.export import export_onnx

    out = hf_folder[0].parent / "hf.onnx"
    export_onnx(hf_folder[0], out, max_segment=8, verify=False)  # HF's own numbers check it here
    return out


def _search(rt, case, zero_memory=True):
    k, n, lp, es, nret, stop, prompt = case
    if zero_memory:
        rt.start_from_zero_memory(1)
    else:
        rt.reset()
    return rt.beam_search(prompt, num_beams=k, max_new_tokens=n, length_penalty=lp, early_stopping=es,
                          num_return_sequences=nret, stop=stop)


def _assert_same(got, want):
    assert [b.tokens for b in got] == [w[0] for w in want]  # a Beam is a (tokens, score) tuple
    np.testing.assert_allclose([b.score for b in got], [w[1] for w in want], rtol=RTOL, atol=TOL)


@pytest.mark.parametrize("backend,lazy", HF_BACKENDS, ids=[f"{b}-{'lazy' if z else 'full'}" for b, z in HF_BACKENDS])
def test_beam_search_decodes_as_huggingface(hf, hf_folder, hf_onnx, backend, lazy):
    folder, model = hf_folder
    path, name = (hf_onnx, None) if backend == "onnxruntime" else (folder, backend)
    with TxlRuntime.load(path, backend=name, lazy=lazy, threads=1) as rt:
        for case in CASES:
            k, n, lp, es, nret, stop, prompt = case
            want = hf_beams(model, prompt, k, n, lp, es, nret, stop)
            _assert_same(_search(rt, case), want)
        if lazy and rt.backend.clusters is not None:
            # the tails were computed only where a beam's cluster could hold one of the best continuations
            stats = rt.tail_stats
            assert stats["decisions"] > 0 and max(stats["tails"]) < stats["decisions"]


@pytest.fixture(scope="module")
def tiny_reference(tiny_ckpt):
    with TxlRuntime.load(tiny_ckpt, backend="torch", threads=1) as rt:
        yield [_search(rt, case, zero_memory=False) for case in CASES]


@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime-full", "torch-fast", "executorch"])
def test_beam_search_agrees_across_backends(request, tiny_ckpt, tiny_onnx, tiny_reference, backend):
    lazy = backend != "onnxruntime-full"
    backend = backend.removesuffix("-full")
    if backend == "executorch":
        pytest.importorskip("executorch", reason="pip install 'txl-deploy[executorch]'")
        path, name = request.getfixturevalue("tiny_pte"), None
    else:
        path, name = (tiny_onnx, None) if backend == "onnxruntime" else (tiny_ckpt, backend)
    with TxlRuntime.load(path, backend=name, threads=1, lazy=lazy) as rt:
        for case, want in zip(CASES, tiny_reference):
            _assert_same(_search(rt, case, zero_memory=False), [(b.tokens, b.score) for b in want])


def test_candidates_are_ranked_best_first_with_ties_to_the_lower_index():
    """The order HuggingFace's top-k gives a step's candidates on distinct values; ties (equal sums, as -1e9 slots
    are) go to the lower index, so a search is reproducible."""
    values = np.array([0.5, -np.inf, 2.0, 0.5, -1e9, 2.0, -1e9, 0.5], dtype=np.float32)
    assert best_first(values, 4).tolist() == [2, 5, 0, 3]
    assert best_first(values, 8).tolist() == [2, 5, 0, 3, 7, 4, 6, 1]
    rng = np.random.default_rng(0)
    big = rng.integers(0, 50, 100_000).astype(np.float32)
    assert best_first(big, 9).tolist() == np.lexsort((np.arange(big.size), -big))[:9].tolist()


def test_the_stream_is_left_holding_the_prompt(tiny_onnx):
    """After the search the memory is the prompt's, one row: going on from it equals going on from the prompt."""
    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        prompt, more = [4, 8, 15, 16, 23, 42, 7, 9, 11], [[3, 5, 7]]
        rt.reset()
        rt.prefill([prompt])
        want_state, want = rt.save_state(), rt.step(more)
        rt.reset()
        best = rt.beam_search(prompt, num_beams=3, max_new_tokens=5)
        assert rt.batch_size == 1 and len(best) == 1 and len(best[0].tokens) <= 5
        for name, array in rt.save_state().items():
            if array.dtype.kind == "f":  # beside the memory: its counts and the model's fingerprint, exactly
                np.testing.assert_allclose(array, want_state[name], rtol=0, atol=TOL, err_msg=name)
            else:
                np.testing.assert_array_equal(array, want_state[name], err_msg=name)
        np.testing.assert_allclose(rt.step(more), want, rtol=0, atol=TOL)
        # without a prompt, it continues from the last call: the same as reading the whole text at once
        again = rt.beam_search(None, num_beams=3, max_new_tokens=4, stop=[1])
        rt.reset()
        _assert_same(again, rt.beam_search(prompt + more[0], num_beams=3, max_new_tokens=4, stop=[1]))


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_beams=1), "num_beams must be a whole number >= 2"),
    (dict(num_beams=61), "at most the vocabulary's size"),
    (dict(max_new_tokens=0), "max_new_tokens must be a whole number >= 1"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
    (dict(num_return_sequences=5), "must be at most num_beams"),
    (dict(stop=[60]), "stop token 60 is not an id"),
    (dict(prompt=[[1, 2], [3, 4]]), "beam_search() runs one stream"),
    (dict(prompt=[99]), "outside the vocabulary"),
])
def test_bad_arguments_are_refused_before_anything_is_fed(tiny_onnx, kwargs, message):
    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        rt.prefill([[1, 2, 3]])
        before = rt.save_state()
        kwargs = {"prompt": [5, 6], **kwargs}
        with pytest.raises(InputError) as e:
            rt.beam_search(kwargs.pop("prompt"), **{"num_beams": 4, **kwargs})
        assert message in str(e.value)
        for name, array in rt.save_state().items():
            np.testing.assert_array_equal(array, before[name])
