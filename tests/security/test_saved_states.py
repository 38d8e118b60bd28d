"""Saved states are checked before they are read (TxlRuntime.load_state: dict, bytes or path).

Every refusal is an InputError that leaves the runtime's memory exactly as it was; a bomb is refused before it
expands; reading a good state costs the state's own size and no more (measured with tracemalloc, which sees numpy's
allocations, and, for the bomb the issue describes, under an address-space limit in a subprocess).
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest
from crafted_files import Member, deflated_zeros, npy_bytes, npy_header, parse_npy, state_zip, zip_bytes

from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.saved_state import max_archive_bytes, read_state_metadata

PROMPT = [[5, 17, 42, 3]]


@pytest.fixture(scope="module")
def rt(tiny_onnx):
    with TxlRuntime.load(tiny_onnx) as runtime:
        yield runtime


@pytest.fixture()
def saved(rt):
    rt.reset()
    rt.step(PROMPT)
    return rt.save_state()


def npz(arrays: dict, compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f") for k in a)


def refused(rt, source, match=None, max_rows=None, peak_limit=1 << 20) -> str:
    """Asserts load_state refuses `source` with an InputError, allocating at most `peak_limit` bytes meanwhile,
    and leaves the runtime's memory (and its last log-probs) as it was; returns the message."""
    before = rt.save_state()
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=match) as err:
            rt.load_state(source, max_rows=max_rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= peak_limit, f"{peak:,} bytes allocated before the refusal: {err.value}"
    assert same_state(rt.save_state(), before)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_state_loads_from_its_dict_bytes_or_path_and_resumes_exactly(rt, saved, tmp_path):
    want = rt.step([[7]])
    path = tmp_path / "state.npz"
    np.savez(path, **saved)
    with_headers = {**saved, "__format__": np.array("txl-deploy conversation state"),
                    "__format_version__": np.array(1), "__sequence_id__": np.array(12, np.int64)}
    for source in (saved, path, str(path), path.read_bytes(), bytearray(path.read_bytes()),
                   np.frombuffer(path.read_bytes(), np.uint8), npz(with_headers), with_headers):
        rt.reset()
        rt.load_state(source)
        np.testing.assert_array_equal(rt.step([[7]]), want)
    meta = read_state_metadata(npz(with_headers))
    assert meta["__sequence_id__"] == 12 and meta["__fingerprint__"] == rt.backend.fingerprint()


def test_the_issues_bomb_is_refused_before_it_expands(rt, saved):
    """About 1 MB that expands to 1 GiB: the first state tensor's header claims 2^17 rows of zeros."""
    rows = 1 << 17
    shape = (rows,) + saved["mem_k.0"].shape[1:]
    header = npy_header(shape, "<f4")
    size = int(np.prod(shape)) * 4
    n = 1 << 30
    assert size <= n
    bomb = state_zip(saved, **{"mem_k.0": Member("mem_k.0.npy", b"", 8, declared_size=len(header) + size,
                                                 compressed=deflate_prefixed(header, n))})
    assert len(bomb) < 1.1e6
    assert "expands to" in refused(rt, bomb)
    assert "larger than this model's state of 1 row" in refused(rt, bomb, max_rows=1)


def deflate_prefixed(prefix: bytes, zeros: int) -> bytes:
    """A raw deflate stream of `prefix` then `zeros` zero bytes."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    return head + deflated_zeros(zeros)


def test_a_member_that_expands_past_what_its_directory_says_stops_there(rt, saved):
    """The directory claims the member's true size and CRC, and its stream goes on for 1 GiB of zeros after
    them: reading stops at the claimed size, so the state is the true one and the zeros are never inflated."""
    real = npy_bytes(saved["mem_k.0"])
    member = Member("mem_k.0.npy", real, 8, compressed=deflate_prefixed(real, 1 << 30))
    archive = state_zip(saved, **{"mem_k.0": member})
    rt.reset()
    tracemalloc.start()
    rt.load_state(archive)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 << 20 and same_state(rt.save_state(), saved)


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "flipped data", "flipped directory",
                                    "flipped local header", "wrong crc", "cut member"])
def test_truncated_or_damaged_archives_are_input_errors(rt, saved, damage):
    good = npz(saved)
    z = zipfile.ZipFile(io.BytesIO(good))
    info = z.getinfo("mem_v.1.npy")
    data_at = info.header_offset + 30 + len(info.filename) + len(info.extra)
    cd_at = good.rindex(b"PK\x01\x02")
    bad = bytearray(good)
    if damage == "empty":
        bad = b""
    elif damage == "garbage":
        bad = bytes(range(256)) * 40
    elif damage == "truncated":
        for cut in (10, len(good) // 3, len(good) - 30):
            refused(rt, good[:cut])
        return
    elif damage == "flipped data":
        bad[data_at + 200] ^= 0x40
    elif damage == "flipped directory":
        bad[cd_at + 16] ^= 0xFF  # the CRC-32 the directory holds
    elif damage == "flipped local header":
        bad[info.header_offset + 26] ^= 0x07  # the local name length
    elif damage == "wrong crc":
        refused(rt, state_zip(saved, **{"mem_v.1": Member("mem_v.1.npy", npy_bytes(saved["mem_v.1"]), 8,
                                                          crc=1234)}), match="CRC")
        return
    elif damage == "cut member":  # the directory says more bytes than the member's stream holds
        raw = npy_bytes(saved["mem_v.1"])
        member = Member("mem_v.1.npy", raw, 0, compressed=raw[:-100])
        bad = state_zip(saved, **{"mem_v.1": member})
    refused(rt, bytes(bad), match="state")


def header_cases(saved):
    """(what, member overrides) for archives whose members do not match this model's state."""
    k0 = saved["mem_k.0"]
    hdr = lambda name, shape, descr="<f4", **kw: Member(  # noqa: E731
        f"{name}.npy", npy_header(shape, descr, **kw) + bytes(int(np.prod(shape)) * np.dtype(descr).itemsize))
    return {
        "unexpected member": {"evil": Member("evil.pkl", b"c__builtin__\neval\n.")},
        "missing member": {"mem_v.1": None},
        "wrong dtype": {"mem_k.0": hdr("mem_k.0", k0.shape, "<f8")},
        "wrong shape": {"mem_k.0": hdr("mem_k.0", k0.shape[:-1] + (k0.shape[-1] + 1,))},
        "rows differ": {"mem_v.1": hdr("mem_v.1", (2,) + saved["mem_v.1"].shape[1:])},
        "object dtype": {"mem_k.0": Member("mem_k.0.npy", npy_header(k0.shape, "|O") + b"\x80\x04N.")},
        "fortran order": {"mem_k.0": hdr("mem_k.0", k0.shape, fortran=True)},
        "huge metadata": {"__fingerprint__": Member("__fingerprint__.npy", npy_header((1 << 30,), "<U64"))},
        "number fingerprint": {"__fingerprint__": hdr("__fingerprint__", (), "<i8")},
        "npy version 3": {"mem_k.0": Member("mem_k.0.npy", npy_header(k0.shape, version=3) + k0.tobytes())},
        "header too large": {"mem_k.0": Member("mem_k.0.npy", npy_header(k0.shape, text="{" + " " * 60000 + "}"))},
        "size differs from header": {"mem_k.0": Member("mem_k.0.npy", npy_bytes(k0) + b"\0" * 64)},
        "encrypted": {"mem_k.0": Member("mem_k.0.npy", npy_bytes(k0), 0, flags=1)},
        "bzip2": {"mem_k.0": Member("mem_k.0.npy", npy_bytes(k0), 12)},
        "duplicate member": {"mem_k.1": None, "dup": None},
        "last log-probs of another vocabulary": {"__last_log_probs__": hdr("__last_log_probs__", (1, 61))},
        "negative count": {"mem_count": Member("mem_count.npy", npy_bytes(np.array([-5], np.int64)))},
    }


@pytest.mark.parametrize("case", list(header_cases({"mem_k.0": np.zeros((1, 2, 8, 12), np.float32),
                                                     "mem_v.1": np.zeros((1, 2, 12, 8), np.float32)})))
def test_members_and_headers_are_checked_against_the_model_before_any_data(rt, saved, case):
    overrides = header_cases(saved)[case]
    if case == "duplicate member":
        members = [Member(f"{k}.npy", npy_bytes(v), 0) for k, v in saved.items()]
        archive = zip_bytes(members + [Member("mem_k.1.npy", npy_bytes(saved["mem_k.1"]), 0)])
    else:
        archive = state_zip(saved, **overrides)
    refused(rt, archive)
    # a dict with the same problem is refused too
    if case in ("wrong dtype", "wrong shape", "rows differ", "missing member", "negative count",
                "last log-probs of another vocabulary"):
        arrays = dict(saved)
        for name, member in overrides.items():
            if member is None:
                arrays.pop(name)
            else:
                head, data = parse_npy(member.data)
                arrays[name] = np.frombuffer(data, head["descr"]).reshape(head["shape"])
        refused(rt, arrays)


def test_a_state_of_another_model_is_refused_by_its_fingerprint_before_its_tensors(rt, saved):
    other = {**saved, "__fingerprint__": np.array("kv-0123456789abcdef-float32")}
    # the tensors are not even looked at: here they are garbage that would fail their own checks
    archive = state_zip(other, **{"mem_k.0": Member("mem_k.0.npy", b"not an npy member at all")})
    assert "another model" in refused(rt, archive)
    assert "another model" in refused(rt, other)
    assert "no fingerprint" in refused(rt, {k: v for k, v in saved.items() if k != "__fingerprint__"})


def test_reading_a_state_costs_its_own_size_and_no_more(tiny_onnx, tmp_path):
    rows = 4096
    with TxlRuntime.load(tiny_onnx) as big:
        big.step(np.tile(np.array(PROMPT), (rows, 1)))
        state = big.save_state(tmp_path / "big.npz")
        size = sum(v.nbytes for v in state.values())
        assert size > 10 << 20
        blob = (tmp_path / "big.npz").read_bytes()
        del state
        big.reset()
        big.step([[1]])
        for source in (tmp_path / "big.npz", blob):
            tracemalloc.start()
            big.load_state(source)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak <= size + (1 << 20), f"{peak:,} bytes to read a state of {size:,}"  # + the read buffer
            assert big.batch_size == rows


def test_rows_a_compressed_state_may_expand_to(rt, saved, tmp_path):
    rt.reset()
    rt.step([[1], [2], [3]])  # one token of twelve memory slots: the rest are zeros, which compress well
    three = rt.save_state()
    rt.reset()
    rt.load_state(npz(three))  # a stored archive holds its own bytes: any number of rows
    assert rt.batch_size == 3
    refused(rt, npz(three), match="at most 1 is accepted", max_rows=1)
    squeezed = npz(three, compressed=True)
    refused(rt, squeezed, match="pass max_rows")  # expands past one row and past its own size
    rt.load_state(squeezed, max_rows=3)
    assert rt.batch_size == 3 and same_state(rt.save_state(), three)
    rt.reset()
    rt.load_state(npz(saved, compressed=True))  # one row always may
    assert max_archive_bytes(rt.backend, 1) < max_archive_bytes(rt.backend, 2)


def test_the_bomb_takes_no_memory_in_a_process_with_little_to_spare(tiny_onnx, tmp_path):
    """The issue's case end to end, outside tracemalloc's view too: a ~1 MB file that expands to 1 GiB, loaded
    from its path in a process whose address space has 200 MB to spare."""
    with TxlRuntime.load(tiny_onnx) as runtime:
        runtime.step(PROMPT)
        saved = runtime.save_state()
    shape = (1 << 17,) + saved["mem_k.0"].shape[1:]
    header = npy_header(shape, "<f4")
    bomb = state_zip(saved, **{"mem_k.0": Member("mem_k.0.npy", b"", 8,
                                                 declared_size=len(header) + int(np.prod(shape)) * 4,
                                                 compressed=deflate_prefixed(header, 1 << 30))})
    (tmp_path / "bomb.npz").write_bytes(bomb)
    script = textwrap.dedent(f"""
        import resource, sys
        from txl_deploy.errors import InputError
        from txl_deploy.runtimes import TxlRuntime
        rt = TxlRuntime.load({str(tiny_onnx)!r})
        rt.step({PROMPT!r})
        vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (200 << 20), vm + (200 << 20)))
        try:
            rt.load_state({str(tmp_path / "bomb.npz")!r})
        except InputError as e:
            print("refused:", e)
        rt.step([[1]])  # and the runtime still runs
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "refused:" in out.stdout and out.stdout.rstrip().endswith("ok"), \
        out.stdout + out.stderr
