"""Streaming evaluation as in the paper, for any backend: numpy only.

The text is read once, left to right, in segments of `tgt_len` tokens; the backend keeps its memory from one
segment to the next, so every token after the first is predicted with up to `mem_len` tokens of extra context
(the paper's evaluation, as opposed to re-reading a sliding window). The first token has no prediction and is
not scored.

A backend is a stateful callable `step(tokens[B, Q] int64) -> log_probs[B, Q, V]` that threads its own memory:
the PyTorch reference, an ONNX Runtime session or a TensorRT engine can all be wrapped that way.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.progress import progress_bar
from txl_deploy.vocab import counting

LN2 = math.log(2.0)


def streaming_eval(ids, step: Callable[[np.ndarray], np.ndarray], tgt_len: int, progress=None) -> dict:
    """Score `ids[1:]` given the preceding tokens, feeding `step` consecutive segments of at most `tgt_len`.

    `progress`, if given, is called with the number of tokens scored after each segment (e.g. `tqdm.update`).
    Returns the summed negative log-likelihood in nats, the token count, the mean loss, bits per token
    (bits per character for character models) and perplexity.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if tgt_len <= 0:
        raise InputError(f"tgt_len must be positive, got {tgt_len}")
    if ids.size < 2:
        raise InputError(f"need at least 2 tokens to evaluate, got {ids.size}")
    inputs, targets = ids[:-1], ids[1:]
    nll = 0.0
    for start in range(0, inputs.size, tgt_len):
        seg = inputs[start : start + tgt_len]
        tgt = targets[start : start + tgt_len]
        log_probs = np.asarray(step(seg[None, :]))
        if log_probs.ndim != 3 or log_probs.shape[:2] != (1, seg.size):
            raise InputError(f"backend returned log-probabilities of shape {log_probs.shape}, "
                             f"expected (1, {seg.size}, vocabulary size)")
        # float64 sum: a few hundred thousand float32 terms would otherwise drift in the 4th digit
        nll -= float(np.take_along_axis(log_probs[0].astype(np.float64), tgt[:, None], axis=1).sum())
        if progress is not None:
            progress(seg.size)
    n = int(targets.size)
    loss = nll / n
    return {
        "nll": nll,
        "n_tokens": n,
        "loss": loss,
        "bits_per_token": loss / LN2,
        "perplexity": math.exp(min(loss, 700.0)),
    }


def evaluate_text(rt, text, tgt_len: int, progress: bool = True, zero_memory: bool = False, raw: bool = False) -> dict:
    """Bits per character (character models) or perplexity (word models) of `text`, memory threaded.

    `text`: a str, or the bytes of a file. It is read as the original preprocessing of the model's corpus read its
    test split (`Vocab.encode_corpus`): for a byte-level enwik8 model the raw bytes, newlines dropped (the model never
    predicts one), so the score is bits per byte of the raw text as the paper counts it; for text8, stripped, with
    `_` for the space. `result["counting"]` says exactly what was counted, `result["input"]` the counts.
    `zero_memory`: start from mem_len zero vectors (TensorFlow's and HuggingFace's first memory), not empty.
    `raw`: a word model reads raw text with its vocabulary's tokenizer instead of a pre-tokenized corpus file."""
    if rt.vocab is None:
        raise InputError("this model has no vocabulary, so it cannot read text to evaluate")
    ids, counts = rt.vocab.encode_corpus(text, raw=raw)
    rt.reset()
    if zero_memory:
        rt.start_from_zero_memory(1)
    start = time.perf_counter()
    with progress_bar(total=max(ids.size - 1, 0), unit="tok", desc="evaluating", enabled=progress) as bar:
        result = streaming_eval(ids, rt.step, tgt_len, progress=bar.update)
    result["seconds"] = time.perf_counter() - start
    rt.reset()
    result["tokens_per_second"] = result["n_tokens"] / max(result["seconds"], 1e-9)
    kind = rt.vocab.kind
    result["unit"] = "ppl" if kind in ("word", "events") else "bpc"  # music models report perplexity per event
    result["score"] = result["bits_per_token"] if result["unit"] == "bpc" else result["perplexity"]
    result["vocab_kind"] = kind
    result["counted"] = {"bytes": "bytes", "word": "tokens", "events": "events"}.get(kind, "characters")
    result["counting"] = counting(kind, counts, result["n_tokens"])
    result["input"] = counts
    return result
