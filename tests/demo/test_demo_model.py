"""The bundled demo model: it loads from the package, scores the recorded bits per character on the held-out
text with streaming evaluation, and generates deterministically within its vocabulary."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from txl_deploy.assets import demo_heldout_path, demo_model_path, demo_training_record
from txl_deploy.errors import InputError
from txl_deploy.runtimes.evaluation import streaming_eval


@pytest.fixture(scope="module")
def demo():
    from txl_deploy.checkpoints import load_ours

    loaded = load_ours(demo_model_path())
    return loaded.build(), loaded.vocab, loaded.config


def torch_step(model):
    """Stateful step for streaming_eval: the PyTorch reference with its memory threaded between calls."""
    state = {"mems": None}

    @torch.no_grad()
    def step(tokens):
        log_probs, state["mems"] = model(torch.from_numpy(np.asarray(tokens, dtype=np.int64)), state["mems"])
        return log_probs.numpy()

    return step


def heldout_slice(vocab, record):
    text = demo_heldout_path().read_text(encoding="utf-8")
    return vocab.encode(text[: record["heldout_slice"]["characters"]])


def test_bundled_model_is_a_small_char_model(demo):
    model, vocab, cfg = demo
    assert vocab.kind == "char" and len(vocab) == cfg.n_token
    size = sum(p.stat().st_size for p in demo_model_path().iterdir())
    assert size <= 8 * 1024 * 1024
    # every held-out character is in the vocabulary (the held-out text must be fully scorable)
    assert set(demo_heldout_path().read_text(encoding="utf-8")) <= set(vocab.symbols)


def test_reference_reproduces_recorded_heldout_bpc(demo):
    model, vocab, cfg = demo
    record = demo_training_record()
    ids = heldout_slice(vocab, record)
    result = streaming_eval(ids, torch_step(model), cfg.tgt_len)
    assert result["n_tokens"] == len(ids) - 1
    assert result["bits_per_token"] == pytest.approx(record["heldout_slice"]["bpc"], abs=0.01)
    # a trained model, not an untrained one: far below log2(vocabulary) bits
    assert result["bits_per_token"] < 0.5 * np.log2(len(vocab))


def test_memory_is_what_the_streaming_score_depends_on(demo):
    """Without the threaded memory (a fresh step per segment) the same text scores worse: the memory is used."""
    model, vocab, cfg = demo
    ids = heldout_slice(vocab, demo_training_record())[:1025]
    with_mem = streaming_eval(ids, torch_step(model), cfg.tgt_len)["bits_per_token"]

    def no_memory(tokens):
        return torch_step(model)(tokens)

    without_mem = streaming_eval(ids, no_memory, cfg.tgt_len)["bits_per_token"]
    assert with_mem < without_mem - 0.05


def greedy(model, vocab, prompt, n):
    step = torch_step(model)
    log_probs = step(vocab.encode(prompt)[None])
    out = []
    for _ in range(n):
        out.append(int(log_probs[0, -1].argmax()))
        log_probs = step(np.array([[out[-1]]]))
    return out


def test_greedy_continuation_is_deterministic_and_in_vocabulary(demo):
    model, vocab, _ = demo
    first = greedy(model, vocab, "And God said", 100)
    second = greedy(model, vocab, "And God said", 100)
    assert first == second
    assert len(first) == 100 and all(0 <= i < len(vocab) for i in first)
    text = vocab.decode(first)
    assert set(text) <= set(vocab.symbols)
    # recognisably the corpus: nearly every whole word of the continuation is a word of the King James text
    corpus_words = set(re.findall(r"[A-Za-z]+", demo_heldout_path().read_text(encoding="utf-8")))
    words = re.findall(r"[A-Za-z]+", text)[:-1]  # the last word may be cut off at 100 characters
    assert len(words) >= 10
    assert sum(w in corpus_words for w in words) >= 0.8 * len(words)


def test_streaming_eval_checks_its_inputs():
    with pytest.raises(InputError, match="at least 2 tokens"):
        streaming_eval([3], lambda t: np.zeros((1, 1, 5)), 4)
    with pytest.raises(InputError, match="shape"):
        streaming_eval([1, 2, 3], lambda t: np.zeros((1, 5)), 4)


def test_streaming_eval_scores_every_token_after_the_first_once():
    """A backend with a known distribution: token t always has probability (t + 1) / 10 (V = 4)."""
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    seen = []

    def step(tokens):
        seen.append(tokens.shape[1])
        return np.broadcast_to(np.log(probs), (1, tokens.shape[1], 4))

    ids = [0, 3, 1, 2, 3, 3, 0]
    result = streaming_eval(ids, step, tgt_len=4)
    assert seen == [4, 2]
    expected = -np.log(probs[ids[1:]]).sum()
    assert result["n_tokens"] == 6
    assert result["nll"] == pytest.approx(expected)
    assert result["bits_per_token"] == pytest.approx(expected / 6 / np.log(2))
