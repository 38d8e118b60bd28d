"""The memory's ring buffer: where a segment's keys and values go. Every backend writes it through `write_ring`.

Slot s of a row that has consumed n tokens holds stream position p with p % mem_len == s (see cached.py), so a
segment of Q tokens into a row that has consumed n goes to slots (n + i) % mem_len. Of a segment longer than the
memory only the last mem_len entries are written: the earlier ones would be overwritten in the same segment.

Keys are [B, n_head, d_head, mem_len] (stored pre-transposed), values [B, n_head, mem_len, d_head]; a segment's
are [B, n_head, d_head, Q] and [B, n_head, Q, d_head]. The same function serves three callers:
- numpy arrays, in place (the ONNX Runtime backend): plain slices, at most two per row (the wrap-around), which
  cost a tenth of a fancy-index write per decode step;
- torch tensors, in place (torch-fast): a scatter with device-side slot indices, no host sync, so the CUDA graph of
  a decode step can capture it;
- torch tensors, `in_place=False` (the `full`-state graph, cached.py): the next memory as new tensors, which is
  what the exported graph outputs.
A fresh memory (a new state, a reset row) is zero rings with the count `initial_mem_count` gives: 0 masks every
slot (the paper's empty memory); mem_len makes all mem_len slots attended zero keys and values, which is what
mem_len zero hidden states project to (qkv_net has no bias): REMI's memory (config `mem_init` "zeros").

This module never imports torch at import time: a tensor only comes from a caller that has loaded torch already,
and the ONNX Runtime and TensorRT backends must stay free of it.
"""

from __future__ import annotations

import numpy as np


def initial_mem_count(config, mem_len: int) -> int:
    """Tokens a fresh row counts as consumed, i.e. the attended zero entries its memory starts with: 0 for an
    empty memory, `mem_len` for `config.mem_init == "zeros"`. Every backend's new state and row reset read it."""
    return int(mem_len) if config.mem_init == "zeros" else 0


def write_ring(k_mem, v_mem, k, v, count, mem_len: int, in_place: bool = True):
    """Write one layer's segment keys `k` and values `v` into the ring buffers `k_mem` / `v_mem` of rows that have
    consumed `count` [B] tokens before this segment. Returns (keys, values): `k_mem`, `v_mem` themselves when
    written in place, new tensors otherwise. `count` is not advanced here (it is shared by every layer)."""
    if isinstance(k_mem, np.ndarray):
        if not in_place:
            k_mem, v_mem = k_mem.copy(), v_mem.copy()
        _write_plan(k_mem, v_mem, k, v, _segment_plan(k.shape[-1], count, mem_len))
        return k_mem, v_mem
    import torch  # a tensor came in, so torch is loaded already

    # Slicing clamps: all Q entries when Q <= mem_len, else the last mem_len (no data-dependent branch, so the
    # graph export keeps the segment length symbolic).
    k_tail, v_tail = k[..., -mem_len:], v[:, :, -mem_len:]
    n = k_tail.shape[-1]
    start = count + (k.shape[-1] - n)  # [B] stream position of the first entry written
    slots = torch.remainder(start[:, None] + torch.arange(n, device=k.device)[None, :], mem_len)  # [B, n]
    B, H, Dh = k.shape[0], k.shape[1], k.shape[2]
    k_idx = slots[:, None, None, :].expand(B, H, Dh, n)
    v_idx = slots[:, None, :, None].expand(B, H, n, Dh)
    if in_place:
        k_mem.scatter_(3, k_idx, k_tail)
        v_mem.scatter_(2, v_idx, v_tail)
        return k_mem, v_mem
    return k_mem.scatter(3, k_idx, k_tail), v_mem.scatter(2, v_idx, v_tail)


def segment_slots(count: int, q: int, mem_len: int) -> np.ndarray:
    """The ring slots a segment of q entries writes in a row that has consumed `count` tokens: those of its last
    min(q, mem_len) entries, in order (what a caller must keep to undo the write)."""
    n = min(q, mem_len)
    return (count + q - n + np.arange(n)) % mem_len


def _write_plan(k_mem, v_mem, k, v, plan):
    for rows, dst, src in plan:
        k_mem[rows, :, :, dst] = k[rows, :, :, src]
        v_mem[rows, :, dst] = v[rows, :, src]


def _segment_plan(q: int, count, mem_len: int) -> list:
    """(rows, ring slots, segment entries) slices that write a segment of q entries into rows that have consumed
    `count` [B]: only its last min(q, mem_len) entries, at most two slice pairs per row (the wrap-around). Rows
    usually move together (one plan for the whole batch); after reset(rows) they differ, and each row gets its own."""
    n = min(q, mem_len)
    start = count + (q - n)  # [B] stream position of the first entry written
    if np.all(start == start[0]):
        groups = [(slice(None), int(start[0]))]
    else:
        groups = [(slice(b, b + 1), int(s)) for b, s in enumerate(start)]
    plan = []
    for rows, first in groups:
        s = first % mem_len
        a = min(n, mem_len - s)  # entries before the end of the buffer; the rest wrap to slot 0
        plan.append((rows, slice(s, s + a), slice(q - n, q - n + a)))
        if a < n:
            plan.append((rows, slice(0, n - a), slice(q - n + a, q)))
    return plan


def write_segment(mems: list, new_entries: list, count, mem_len: int):
    """Every layer's segment (new_k.0, new_v.0, new_k.1, ...) into the memory (mem_k.0, mem_v.0, ...), in place,
    then `count` [B] advanced by the segment length, in place: the state after the segment. Numpy rings share one
    slice plan over the layers (a decode step writes 2 x n_layer small slices: the plan is most of their cost)."""
    if mems and isinstance(mems[0], np.ndarray):
        plan = _segment_plan(new_entries[0].shape[-1], count, mem_len)
        for k_mem, v_mem, k, v in zip(mems[::2], mems[1::2], new_entries[::2], new_entries[1::2]):
            _write_plan(k_mem, v_mem, k, v, plan)
    else:
        for i in range(0, len(mems), 2):
            write_ring(mems[i], mems[i + 1], new_entries[i], new_entries[i + 1], count, mem_len)
    count += new_entries[0].shape[-1]
