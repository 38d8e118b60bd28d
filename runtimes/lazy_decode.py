"""Lazy decoding over a batch: the head for every row, then only the tails the rows' samplers ask for.

An adaptive-softmax word model's tails are most of a decode step's bytes (62% for the WikiText-103 base shape), and
a sampler can often decide from the head alone (the shortlist holds most of the mass). `decide` starts every row's
decision on its head log-probs (`Sampler.start`), gathers the rows that need tail cluster i into one batched
`backend.run_tail(i, ...)` call, reveals each row's slice, and repeats until every row has decided. The tokens are
the ones `Sampler.choose_parts` picks given the same head and tails: the sampler's decision is one algorithm,
answered as it asks (docs/sampling.md).

Used by `TxlRuntime.generate` and the HTTP server's batched decoder; a backend takes part when its `clusters` is
set (see runtimes/backend.py: run_head, run_tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from txl_deploy.errors import InputError


@dataclass
class Decision:
    """What `decide` returns: `choices[r]` (None for a row without a sampler, or one dropped by `failed`),
    `tokens[r]` (-1 there), and `tail_rows[i - 1]`, how many rows tail cluster i was computed for, in
    `tail_calls[i - 1]` batched calls."""

    choices: list
    tokens: np.ndarray
    tail_rows: np.ndarray
    tail_calls: np.ndarray


def decide(backend, samplers, hidden: np.ndarray, head: np.ndarray, failed=None) -> Decision:
    """Decide one token per row whose sampler is not None.

    hidden [B, d_model] and head [B, shortlist + n] are `backend.run_head`'s outputs at the position decided
    (e.g. `[:, -1]`); samplers[r] is row r's Sampler (built with the model's clusters) or None to skip the row.
    Each round runs every needed cluster once, on the rows that need it, in cluster order.

    failed(r, error): where rows are independent requests (a server's batch), a row whose sampler raises
    InputError (its parameters leave no token) is told there and dropped (choice None, token -1) while the others
    go on; without it the error propagates. A tail graph's failure always propagates: it concerns every row."""
    clusters = backend.clusters
    n = clusters.n_clusters
    choices = [None] * len(samplers)

    def drop(r, error):
        if failed is None:
            raise error
        failed(r, error)
        choices[r] = None

    for r, s in enumerate(samplers):
        if s is not None:
            try:
                choices[r] = s.start(head[r])
            except InputError as e:
                drop(r, e)
    tail_rows = np.zeros(n, dtype=np.int64)
    tail_calls = np.zeros(n, dtype=np.int64)
    while True:
        wanted: dict[int, list[int]] = {}
        for r, c in enumerate(choices):
            if c is not None:
                for i in c.needs:
                    wanted.setdefault(int(i), []).append(r)
        if not wanted:
            break
        for i in sorted(wanted):
            rows = np.asarray(wanted[i], dtype=np.int64)
            col = clusters.head_column(i)
            log_probs = backend.run_tail(i, np.ascontiguousarray(hidden[rows], dtype=np.float32),
                                         np.ascontiguousarray(head[rows, col], dtype=np.float32))
            tail_rows[i - 1] += rows.size
            tail_calls[i - 1] += 1
            for k, r in enumerate(rows):
                if choices[r] is None:  # dropped (failed) after this round's requests were gathered
                    continue
                try:
                    choices[r].reveal(i, log_probs[k])
                except InputError as e:
                    drop(r, e)
    tokens = np.array([-1 if c is None else int(c.token) for c in choices], dtype=np.int64)
    return Decision(choices, tokens, tail_rows, tail_calls)


def full_log_probs(backend, hidden: np.ndarray, head: np.ndarray) -> np.ndarray:
    """The full log-probs [B, V] from run_head's outputs at one position (hidden [B, d_model], head [B, H]): the
    shortlist's head columns followed by every tail, the exported graph's composition."""
    clusters = backend.clusters
    tails = [backend.run_tail(i, np.ascontiguousarray(hidden, dtype=np.float32),
                              np.ascontiguousarray(head[:, clusters.head_column(i)], dtype=np.float32))
             for i in range(1, clusters.n_clusters + 1)]
    return clusters.compose(head, tails)


__all__ = ["Decision", "decide", "full_log_probs"]
