"""The one ring-buffer write (txl_deploy/ring.py) against the definition: token j of a segment fed to a row that
has consumed n tokens lands in slot (n + j) % mem_len, later tokens overwriting earlier ones."""

from __future__ import annotations

import numpy as np
import pytest

from txl_deploy.contract.ring import segment_slots, write_ring, write_segment

H, DH = 2, 3


def _by_definition(k_mem, v_mem, k, v, count, M):
    k_mem, v_mem = k_mem.copy(), v_mem.copy()
    for b in range(k.shape[0]):
        for j in range(k.shape[-1]):
            slot = (int(count[b]) + j) % M
            k_mem[b, :, :, slot] = k[b, :, :, j]
            v_mem[b, :, slot] = v[b, :, j]
    return k_mem, v_mem


def _case(rng, counts, q, M):
    B = len(counts)
    k_mem = rng.standard_normal((B, H, DH, M)).astype(np.float32)
    v_mem = rng.standard_normal((B, H, M, DH)).astype(np.float32)
    k = rng.standard_normal((B, H, DH, q)).astype(np.float32)
    v = rng.standard_normal((B, H, q, DH)).astype(np.float32)
    return k_mem, v_mem, k, v, np.array(counts, dtype=np.int64)


CASES = [
    ([0], 1, 5), ([3], 1, 5), ([4], 1, 5),  # decode, the last slot, the wrap
    ([2, 2], 3, 5), ([3, 3], 4, 5),  # a segment crossing the end of the buffer
    ([7, 7], 5, 5), ([1], 12, 5),  # as long as the memory; longer: only the last mem_len survive
    ([0, 3, 9], 4, 5), ([4, 0], 7, 5),  # rows at different positions (after reset(rows))
    ([5], 3, 1),  # mem_len 1
]


@pytest.mark.parametrize("counts, q, M", CASES)
def test_numpy_write_matches_the_definition(counts, q, M):
    k_mem, v_mem, k, v, count = _case(np.random.default_rng(q * 100 + M), counts, q, M)
    want = _by_definition(k_mem, v_mem, k, v, count, M)
    got_k, got_v = write_ring(k_mem, v_mem, k, v, count, M)
    assert got_k is k_mem and got_v is v_mem  # in place
    np.testing.assert_array_equal(k_mem, want[0])
    np.testing.assert_array_equal(v_mem, want[1])


@pytest.mark.parametrize("counts, q, M", CASES)
def test_segment_slots_are_exactly_the_slots_a_write_changes(counts, q, M):
    """What a server keeps to undo a row's write (serving.rows) is what the write touches, no more, no less."""
    k_mem, v_mem, k, v, count = _case(np.random.default_rng(q * 100 + M), counts, q, M)
    k += 1000  # every new entry differs from every old one
    before = k_mem.copy()
    write_ring(k_mem, v_mem, k, v, count, M)
    for b, n in enumerate(counts):
        changed = np.flatnonzero((k_mem[b] != before[b]).any(axis=(0, 1)))
        slots = segment_slots(n, q, M)
        assert sorted(slots) == list(changed) and len(set(slots)) == len(slots)


@pytest.mark.parametrize("counts, q, M", CASES)
def test_torch_in_place_and_graph_writes_match_the_definition(counts, q, M):
    import torch  # heavy: the other cases of this module run without it
    k_mem, v_mem, k, v, count = _case(np.random.default_rng(q * 100 + M), counts, q, M)
    want = _by_definition(k_mem, v_mem, k, v, count, M)
    t = [torch.from_numpy(a.copy()) for a in (k_mem, v_mem, k, v, count)]
    new_k, new_v = write_ring(*t[:2], *t[2:4], t[4], M, in_place=False)  # the exported graph's form
    np.testing.assert_array_equal(new_k.numpy(), want[0])
    np.testing.assert_array_equal(new_v.numpy(), want[1])
    np.testing.assert_array_equal(t[0].numpy(), k_mem)  # inputs untouched
    write_ring(*t[:2], *t[2:4], t[4], M)  # torch-fast's form
    np.testing.assert_array_equal(t[0].numpy(), want[0])
    np.testing.assert_array_equal(t[1].numpy(), want[1])


def test_numpy_copy_form_leaves_the_inputs_alone():
    k_mem, v_mem, k, v, count = _case(np.random.default_rng(0), [3, 1], 4, 5)
    before = k_mem.copy(), v_mem.copy()
    new_k, new_v = write_ring(k_mem, v_mem, k, v, count, 5, in_place=False)
    np.testing.assert_array_equal(k_mem, before[0])
    want = _by_definition(k_mem, v_mem, k, v, count, 5)
    np.testing.assert_array_equal(new_k, want[0])
    np.testing.assert_array_equal(new_v, want[1])


@pytest.mark.parametrize("counts, q, M", CASES)
def test_write_segment_covers_every_layer_and_advances_the_count(counts, q, M):
    rng = np.random.default_rng(1)
    layers = [_case(rng, counts, q, M) for _ in range(3)]
    count = np.array(counts, dtype=np.int64)
    mems = [a for layer in layers for a in layer[:2]]
    want = [x for layer in layers for x in _by_definition(*layer[:4], count, M)]
    write_segment(mems, [a for layer in layers for a in layer[2:4]], count, M)
    for got, w in zip(mems, want):
        np.testing.assert_array_equal(got, w)
    np.testing.assert_array_equal(count, np.array(counts) + q)


def test_ring_module_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys\nimport txl_deploy.contract.ring, txl_deploy.runtimes.backends.onnxruntime\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
