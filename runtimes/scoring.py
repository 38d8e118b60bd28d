"""Scoring many texts at batch speed (`TxlRuntime.score_texts`, `txl-deploy score`): each text's log-probability
given its context, as n-best rescoring needs it.

The items that share a context (one group) are scored from one reading of it: the context is fed once, as one
row, and its memory is forked into a row per hypothesis (`select_rows`); the hypotheses then run as one batch,
padded at their ends. Rows are independent streams and a position never sees a later one, so padding changes no
real position's log-prob; the padded positions are not counted. Without `same_length` a token's prediction depends
on where the segments start (the paper's evaluation cuts fixed segments) once the text outgrows the memory, so
there the shared reading stops at the last whole segment of the context and each row re-reads the rest: every
result equals `TxlRuntime.score` of start + context + text alone, either way. What is counted: docs/scoring.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.progress import progress_bar
from txl_deploy.runtimes.saved_state import row_bytes
from txl_deploy.runtimes.score_input import ScoreItem

# Bound on materialised log-probs per call when scoring (floats), so a 267k-word vocabulary stays in memory.
SCORE_CHUNK_FLOATS = 32 * 1024 * 1024
BATCH_BUDGET_BYTES = 1 << 30  # memory of one batch of rows: their state, log-prob chunk and temporaries
MAX_ROWS = 512  # rows in one batch whatever the budget: a small model's budget would allow thousands


def score_chunk(backend, batch: int) -> int:
    """Positions fed per call when every position's log-probs are wanted: max_segment, or fewer so that
    [batch, chunk, vocabulary] stays within SCORE_CHUNK_FLOATS."""
    return max(1, min(backend.max_segment, SCORE_CHUNK_FLOATS // (batch * backend.config.n_token)))


@dataclass
class _Row:
    item: int  # the item's place in the input
    ids: np.ndarray  # start + context + text
    counted_from: int  # the first counted position of `ids`
    text_from: int  # where the text begins in `ids`


@dataclass
class _Group:
    context: str
    prefix: np.ndarray  # start + context
    rows: list


def score_texts(rt, items, per_token: bool = False, batch_budget: int = BATCH_BUDGET_BYTES, start: bool = True,
                line_end: bool = False, progress: bool = False) -> list[dict]:
    """Score each item (a str, a `ScoreItem`, or a dict with "text" and optionally "context" and "group") on
    runtime `rt`; return one dict per item, in input order: `log_prob` (natural log, summed over the counted
    tokens), `n_tokens` (how many are counted), `perplexity` (exp of the mean negative log-prob), and with
    `per_token` the text's `tokens` (symbols), `token_ids` and `token_log_probs` (None where a token is not
    predicted). A bad item gets {"error": "..."} and the others are scored all the same.

    Counted: every token of the text, predicted from the context before it, after the vocabulary's line end
    (`<eos>`; One Billion Word: `<S>`) as the start of the line when `start` and the vocabulary has one; else the
    first token of a text without context has nothing before it and is not counted. `line_end`: score the text as a closed line, its
    line end (`<eos>`) counted too. The memory of `rt` is used and left empty (reset).
    batch_budget: bytes a batch may take (each row's memory, its log-prob chunk and its share of the model's
    temporaries, `rows_within`); at least one row runs."""
    vocab = rt.vocab
    if vocab is None:
        raise InputError("this model has no vocabulary, so it cannot read texts to score")
    items = list(items)
    start_ids = np.array([vocab.index[vocab.eos]] if start and vocab.eos is not None else [], dtype=np.int64)
    results: list = [None] * len(items)
    groups: dict = {}
    for i, item in enumerate(items):
        try:
            item = _as_item(item)
            key = ("group", item.group) if item.group is not None else ("context", item.context or "")
            group = groups.get(key)
            if group is None:
                prefix = np.concatenate([start_ids, rt.encode(item.context) if item.context else start_ids[:0]])
                group = groups[key] = _Group(item.context or "", prefix, [])
            elif group.context != (item.context or ""):
                raise InputError(f"group {item.group!r} was given another context before (the hypotheses of one "
                                 "group share one context)")
            group.rows.append(_row(rt, i, item, group.prefix, line_end))
        except InputError as e:
            results[i] = {"error": str(e)}
    chunk = score_chunk(rt.backend, 1)  # what TxlRuntime.score feeds one row at a time
    total = sum(r.ids.size - r.counted_from for g in groups.values() for r in g.rows)
    with progress_bar(total=total, unit="tok", desc="scoring", enabled=progress) as bar:
        for group in groups.values():
            if group.rows:
                _score_group(rt, group, chunk, int(batch_budget), bar.update, results, per_token)
    rt.reset()
    return results


def _as_item(item) -> ScoreItem:
    if isinstance(item, str):
        item = ScoreItem(item)
    elif isinstance(item, dict):
        unknown = [k for k in item if k not in ("text", "context", "group")]
        if unknown:
            raise InputError(f"unknown field {str(unknown[0])[:40]!r} (fields: text, context, group)")
        item = ScoreItem(item.get("text"), item.get("context"), item.get("group"))
    elif not isinstance(item, ScoreItem):
        raise InputError(f"an item must be a str, a ScoreItem or a dict, got {type(item).__name__}")
    if not isinstance(item.text, str):
        raise InputError(f"the text must be a str, got {type(item.text).__name__}")
    if item.context is not None and not isinstance(item.context, str):
        raise InputError(f"the context must be a str or None, got {type(item.context).__name__}")
    if item.group is not None and (isinstance(item.group, bool) or not isinstance(item.group, (str, int))):
        raise InputError(f"the group must be a str, an int or None, got {type(item.group).__name__}")
    return item


def _row(rt, index: int, item: ScoreItem, prefix: np.ndarray, line_end: bool) -> _Row:
    if not item.text:
        raise InputError("empty text")
    text = rt.encode(item.text + "\n" if line_end else item.text)
    if not text.size:
        raise InputError("the text has no tokens (only whitespace?)")
    ids = np.concatenate([prefix, text])
    counted_from = max(prefix.size, 1)
    if ids.size <= counted_from:
        raise InputError("nothing to score: the text's only token has nothing before it to predict it (give it a "
                         "context)")
    return _Row(index, ids, counted_from, prefix.size)


def rows_within(rt, budget: int, q: int) -> int:
    """Rows a batch fed `q` positions a call may hold within `budget` bytes: each row's memory, its log-probs and
    its share of the call's temporaries (at least one row, at most MAX_ROWS)."""
    row = row_bytes(rt.backend) + 4 * rt.n_token * q + rt.config.activation_bytes(1, q, rt.mem_len)
    return max(1, min(MAX_ROWS, budget // row))


def _score_group(rt, group: _Group, chunk: int, budget: int, progress, results: list, per_token: bool):
    """Feed the group's shared prefix once, fork it into a row per hypothesis, score the hypotheses in batches."""
    prefix = group.prefix
    # without same_length, cuts change nothing only while every token so far still fits in the memory
    cuts_matter = not rt.config.same_length and max(r.ids.size for r in group.rows) > rt.mem_len
    shared = prefix.size // chunk * chunk if cuts_matter else prefix.size
    rt.reset()
    last = saved = None
    for k in range(0, shared, chunk):  # cut as TxlRuntime.score cuts the text alone
        last = rt.prefill(prefix[None, k:k + chunk])
    rows = sorted(group.rows, key=lambda r: -r.ids.size)  # longest first, like lengths together: less padding
    b = 0
    while b < len(rows):
        batch = rows[b:b + rows_within(rt, budget, max(1, min(chunk, rows[b].ids.size - shared - 1)))]
        if shared:
            if b == 0 and len(batch) < len(rows):
                saved = rt.save_state()  # the context's memory, for the next batches
            elif b:
                rt.load_state(saved)
            rt.select_rows([0] * len(batch))  # the context's memory and last distribution, in every row
        else:
            rt.reset()
        log_probs = _batch_log_probs(rt, [r.ids[shared:] for r in batch], chunk, last)
        for r, lp in zip(batch, log_probs):
            results[r.item] = _result(rt, r, lp[r.counted_from - shared:], per_token)
        progress(sum(r.ids.size - r.counted_from for r in batch))
        b += len(batch)


def _batch_log_probs(rt, sequences: list, chunk: int, last) -> list:
    """Log-prob of each token of each sequence given the memory of its row (the first token's from `last`, the
    distribution the memory ends on; NaN without one). Rows are padded at their ends; the padding is never read."""
    lengths = [s.size for s in sequences]
    tokens = np.zeros((len(sequences), max(lengths)), dtype=np.int64)
    for i, s in enumerate(sequences):
        tokens[i, :s.size] = s
    out = np.full(tokens.shape, np.nan, dtype=np.float32)
    if last is not None:
        out[:, 0] = last[0, tokens[:, 0]]
    fed = tokens.shape[1] - 1  # the last token predicts nothing that is counted
    for k in range(0, fed, chunk):
        q = min(chunk, fed - k)
        lp = rt.step(tokens[:, k:k + q])  # [rows, q, V]
        out[:, k + 1:k + 1 + q] = np.take_along_axis(lp, tokens[:, k + 1:k + 1 + q, None], axis=2)[..., 0]
    return [out[i, :n] for i, n in enumerate(lengths)]


def _result(rt, row: _Row, log_probs: np.ndarray, per_token: bool) -> dict:
    total = float(log_probs.astype(np.float64).sum())  # float64 sum, as eval sums
    n = int(log_probs.size)
    result = {"log_prob": total, "n_tokens": n, "perplexity": math.exp(min(-total / n, 700.0))}
    if per_token:
        text = row.ids[row.text_from:]
        uncounted = row.counted_from - row.text_from  # 1 when the text's first token has no prediction
        result["tokens"] = [rt.vocab.symbols[int(t)] for t in text]
        result["token_ids"] = text.tolist()
        result["token_log_probs"] = [None] * uncounted + [float(v) for v in log_probs]
    return result


def score_lines(rt, lines: list, **how) -> list[dict]:
    """`score_texts` over the lines `score_input.read_input` read: one record per line, in order, with its `line`
    number (and its `id`, its `group` when given), then the scores or the line's `error`."""
    scored = iter(score_texts(rt, [line.item for line in lines if line.item is not None], **how))
    records = []
    for line in lines:
        record = {"line": line.line}
        if line.id is not None:
            record["id"] = line.id
        if line.item is not None and line.item.group is not None:
            record["group"] = line.item.group
        record.update(next(scored) if line.item is not None else {"error": line.error})
        records.append(record)
    return records
