"""Sizes read from a file are checked against the file before anything is allocated for them.

Each file below claims 2^40 elements (or bytes) that it does not hold, in one of the places a reader takes a size
from: a TensorFlow bundle entry and its shard offset, a safetensors header, a pickle's storages and opcodes (legacy
and zip torch.save files, cache.pkl), an .npy header, an ONNX field length. Every case runs in one subprocess whose
address space is limited to what it had after its imports plus 512 MB: a reader that asked the allocator for the
claimed size would fail there with an allocation error. Each must instead give the project's own error (a
CheckpointError, or an InputError for inputs that are not checkpoints), naming the file, with no allocation
failure behind it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BIG = 2**40

WORKER = textwrap.dedent("""
    import json, resource, sys, traceback
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import numpy as np, torch, onnx  # everything imported before the limit
    import crafted_files as cf
    from txl_deploy.checkpoints import load_model
    from txl_deploy.checkpoints.huggingface import read_weights
    from txl_deploy.checkpoints.torch_files import torch_load
    from txl_deploy.checkpoints.tensorflow.bundle import TFCheckpoint
    from txl_deploy.checkpoints.vocab_files import read_vocab_file
    from txl_deploy.contract.metadata import read_onnx_info
    from txl_deploy.contract.onnx_file import external_data
    from txl_deploy.exporters.precision.token_data import read_token_ids
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.errors import TxlError
    folder, onnx_path = Path(sys.argv[2]), Path(sys.argv[3])
    BIG = 2**40
    rt = TxlRuntime.load(onnx_path)
    rt.step([[1, 2]])
    state = rt.save_state()
    onnx_bytes = onnx_path.read_bytes()

    def tf(entries, shard=16):
        prefix = folder / "tf" / "model.ckpt-0"
        prefix.parent.mkdir(exist_ok=True)
        (prefix.parent / "model.ckpt-0.data-00000-of-00001").write_bytes(bytes(shard))
        cf.write_index(prefix, entries)
        ckpt = TFCheckpoint(prefix)
        return [ckpt.get_tensor(n) for n in ckpt.names()]

    def write(name, data):
        path = folder / name
        path.write_bytes(data)
        return path

    def pickled(*ops):  # a protocol-4 pickle of raw opcodes
        return b"\\x80\\x04" + b"".join(ops) + b"."

    cases = {
        "tf entry larger than its shard": lambda: tf({"w": (1, [BIG], 0, 0, 4 * BIG, 0)}),
        "tf offset past its shard": lambda: tf({"w": (1, [4], 0, BIG, 16, 0)}),
        "tf dimensions whose product wraps": lambda: tf({"w": (1, [2**32, 2**32], 0, 0, 0, 0)}),
        "safetensors header": lambda: read_weights(write("w.safetensors", cf.safetensors_file(
            {"w": {"dtype": "F32", "shape": [BIG], "data_offsets": [0, 4 * BIG]}}, bytes(16)))),
        "safetensors header length": lambda: read_weights(write("h.safetensors", (BIG).to_bytes(8, "little") + b"{}")),
        "legacy storage": lambda: torch_load(write("legacy.pt", cf.legacy_torch_file(
            {"w": cf.tensor("0", BIG)}, {"0": 4}))),
        "zip storage": lambda: torch_load(write("zip.pt", cf.zip_torch_file({"w": cf.tensor("0", BIG)}, {"0": 4}))),
        "view larger than its storage": lambda: torch_load(write("view.pt", cf.zip_torch_file(
            {"w": cf.tensor("0", 4, shape=(BIG,), stride=(0,))}, {"0": 4}))),
        "pickle bytes length": lambda: torch_load(write("bytes8.pt", pickled(b"\\x8e" + BIG.to_bytes(8, "little")))),
        "pickle frame length": lambda: torch_load(write("frame.pt", pickled(b"\\x95" + BIG.to_bytes(8, "little")))),
        "pickle memo index": lambda: torch_load(write("memo.pt", pickled(b"N", b"r" + (2**32 - 1).to_bytes(4, "little")))),
        "pickle bytes of a size": lambda: torch_load(write("bytesof.pt", cf.legacy_torch_file(
            cf.Reduce(bytes, (BIG,)), {}))),
        "cache.pkl bytes length": lambda: read_vocab_file(write("cache.pkl", pickled(b"\\x8e" + BIG.to_bytes(8, "little")))),
        "onnx field length": lambda: read_onnx_info(write("len.onnx", cf.onnx_with_length(onnx_bytes, 7, BIG))),
        "onnx external data walk": lambda: external_data(write("walk.onnx", cf.onnx_with_length(onnx_bytes, 7, BIG))),
        "npy token ids": lambda: read_token_ids(write("ids.npy", cf.npy_header((BIG,), "<i8") + bytes(64)), None, 60),
        "saved state": lambda: rt.load_state(write("state.npz", cf.state_zip(state, **{"mem_k.0": cf.Member(
            "mem_k.0.npy", cf.npy_header((BIG, 2, 8, 12)) + bytes(64), 0)}))),
    }
    vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
    results = {}
    for name, case in cases.items():
        try:
            case()
            results[name] = {"type": None, "message": "read without an error"}
        except BaseException as e:
            results[name] = {"type": type(e).__name__, "message": str(e),
                             "trace": "".join(traceback.format_exception(e))[-1500:]}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def outcomes(tiny_onnx, tmp_path_factory):
    folder = tmp_path_factory.mktemp("claims")
    out = subprocess.run([sys.executable, "-c", WORKER, str(HERE), str(folder), str(tiny_onnx)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), folder


CASES = {  # case -> (error class, the file named, what the message says)
    "tf entry larger than its shard": ("CheckpointError", "model.ckpt-0.data-00000-of-00001", "the file holds 16"),
    "tf offset past its shard": ("CheckpointError", "model.ckpt-0.data-00000-of-00001", "the file holds 16"),
    "tf dimensions whose product wraps": ("CheckpointError", "model.ckpt-0.index", "do not fit shape"),
    "safetensors header": ("CheckpointError", "w.safetensors", "not a readable safetensors file"),
    "safetensors header length": ("CheckpointError", "h.safetensors", "header too large"),
    "legacy storage": ("CheckpointError", "legacy.pt", "more than the file's"),
    "zip storage": ("CheckpointError", "zip.pt", "its record holds 16"),
    "view larger than its storage": ("CheckpointError", "view.pt", "larger than its storage"),
    "pickle bytes length": ("CheckpointError", "bytes8.pt", "left in the file"),
    "pickle frame length": ("CheckpointError", "frame.pt", "a frame of"),
    "pickle memo index": ("CheckpointError", "memo.pt", "memo index"),
    "pickle bytes of a size": ("CheckpointError", "bytesof.pt", "only of data"),
    "cache.pkl bytes length": ("CheckpointError", "cache.pkl", "left in the file"),
    "onnx field length": ("CheckpointError", "len.onnx", "not a readable ONNX model"),
    "onnx external data walk": ("CheckpointError", "walk.onnx", "not a readable ONNX model"),
    "npy token ids": ("InputError", "ids.npy", "not a readable .npy"),
    "saved state": ("InputError", "state.npz", "more than this file may expand to"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_claim_of_2_to_the_40_is_refused_against_the_file(outcomes, case):
    results, folder = outcomes
    got = results[case]
    kind, named, says = CASES[case]
    assert got["type"] == kind, got.get("trace", got)
    assert named in got["message"] and says in got["message"], got["message"]
    assert "alloc" not in got["message"].lower() and "memory" not in got["message"].lower(), got["message"]
