"""What the fuzz tests found, kept as plain regression tests: each file is refused with the project's own error
(CheckpointError for checkpoints and models, InputError for saved states) instead of a library's exception."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
from crafted_files import (
    Member,
    bundle_entry,
    field,
    npy_header,
    state_zip,
    table_bytes,
    tensor,
    write_bundle,
    zip_torch_file,
)

from txl_deploy.checkpoints import load_model
from txl_deploy.errors import CheckpointError, InputError


@pytest.mark.parametrize("name", ["config.json", "vocab.json"])
def test_json_nested_deeper_than_python_recurses(tiny_ckpt, tmp_path, name):
    """RecursionError escaped json.loads through load_model."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=name):
        load_model(folder)


def test_a_torch_archive_with_an_unknown_persistent_id(tmp_path):
    """torch's zip loader asserts (AssertionError) on a persistent id that is not a storage."""
    src = zipfile.ZipFile(io.BytesIO(zip_torch_file({"w": tensor("0", 4)}, {"0": 4})))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:  # written anew: zip's CRC-32 is of the changed data.pkl
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = data.replace(b"storage", b"rtorage", 1)  # the persistent id's typename
            z.writestr(info.filename, data)
    (tmp_path / "model.pt").write_bytes(out.getvalue())
    with pytest.raises(CheckpointError, match="model.pt"):
        load_model(tmp_path / "model.pt", config={"n_token": 4, "n_layer": 1, "n_head": 1, "d_model": 4,
                                                  "d_head": 4, "d_inner": 4})


def test_an_npy_header_numpy_cannot_tokenize(tiny_onnx):
    """numpy's header reader raised tokenize.TokenError (not a ValueError) for an unclosed parenthesis."""
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(tiny_onnx) as rt:
        rt.step([[1, 2]])
        state = rt.save_state()
        text = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2"
        archive = state_zip(state, **{"mem_k.0": Member("mem_k.0.npy", npy_header((), text=text), 0)})
        with pytest.raises(InputError, match="damaged"):
            rt.load_state(archive)


@pytest.mark.parametrize("where", ["shape as a number", "dtype as bytes", "a dimension as a number",
                                   "num_shards as bytes"])
def test_a_bundle_field_of_the_wrong_wire_type(tmp_path, where):
    """The bundle reader took a field's value as the type it expected (TypeError: int has no len())."""
    from txl_deploy.checkpoints.tensorflow.bundle import TFCheckpoint

    prefix = tmp_path / "model.ckpt-0"
    entries = write_bundle(prefix, {"w": np.arange(4, dtype=np.float32)})
    dtype, shape, shard, offset, size, crc = entries["w"]
    value = bundle_entry(dtype, shape, shard, offset, size, crc)
    header = field(1, 1)
    if where == "shape as a number":
        value = field(1, dtype) + field(2, 7) + field(4, offset) + field(5, size)
    elif where == "dtype as bytes":
        value = field(1, b"\x01") + value[2:]
    elif where == "a dimension as a number":
        value = field(1, dtype) + field(2, field(2, 4)) + field(4, offset) + field(5, size)
    else:
        header = field(1, b"\x01")
    (tmp_path / "model.ckpt-0.index").write_bytes(table_bytes([(b"", header), (b"w", value)]))
    with pytest.raises(CheckpointError, match="model.ckpt-0.index"):
        ckpt = TFCheckpoint(prefix)
        ckpt.get_tensor("w")


@pytest.mark.parametrize("key, value", [("cutoffs", ":"), ("mem_len", "12"), ("tie_projs", 3),
                                        ("layer_norm_epsilon", None), ("n_layer", True),
                                        ("d_model", 10**400), ("mem_len", 2**63)])
def test_a_config_value_of_the_wrong_type(tiny_ckpt, tmp_path, key, value):
    """TxlConfig converted cutoffs with int() before checking them (ValueError: invalid literal for int()); a
    d_model past 2**63 reached len(range(...)) (OverflowError) while reading the weights."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    meta = json.loads((folder / "config.json").read_text())
    meta["config"][key] = value
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"config.json: bad config: invalid Transformer-XL config: {key}"):
        load_model(folder)


@pytest.mark.parametrize("where", ["initializer's external_data", "metadata"])
def test_a_key_value_entry_protobuf_cannot_parse(tmp_path, where):
    """protobuf's DecodeError (not a ValueError) escaped the external-data walk for an entry that ends inside its
    key; the metadata reader let it through to its caller too."""
    from txl_deploy.contract.metadata import read_onnx_info
    from txl_deploy.contract.onnx_file import external_data

    damaged = field(1, b"key")[:-1]  # a key of 3 bytes of which 2 are there
    if where == "metadata":  # metadata_props (14)
        model, read = field(1, 8) + field(14, damaged) + field(7, field(1, b"")), read_onnx_info
    else:  # graph (7) > initializer (5) > external_data (13)
        model, read = field(1, 8) + field(7, field(5, field(8, b"w") + field(13, damaged))), external_data
    path = tmp_path / "model.onnx"
    path.write_bytes(model + field(8, field(2, 18)))  # opset 18
    with pytest.raises(CheckpointError, match="model.onnx"):
        read(path)


@pytest.mark.parametrize("export", [{"mem_len": 8}, {"mem_len": "8", "max_segment": 16},
                                    {"mem_len": 8, "max_segment": 16, "state": ["full"]}, []])
def test_export_settings_missing_or_of_the_wrong_type(tiny_onnx, tmp_path, export):
    """A damaged .ort file's metadata without max_segment reached the runtime as a KeyError; the settings every
    runtime sizes its memory from are now checked where the metadata is read, for every file kind."""
    import onnx

    from txl_deploy.contract.metadata import KEY_EXPORT, read_onnx_info
    from txl_deploy.runtimes import TxlRuntime

    model = onnx.load(str(tiny_onnx))
    for prop in model.metadata_props:
        if prop.key == KEY_EXPORT:
            prop.value = json.dumps(export)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    with pytest.raises(CheckpointError, match="model.onnx: corrupt txl-deploy metadata"):
        read_onnx_info(path)
    with pytest.raises(CheckpointError, match="model.onnx: corrupt txl-deploy metadata"):
        TxlRuntime.load(path)


def test_an_ort_file_whose_input_name_is_not_utf8(tiny_onnx, tmp_path):
    """ONNX Runtime loads a .ort file whose graph-input name is not UTF-8; its Python binding then raised
    UnicodeDecodeError from session.get_inputs() inside the runtime's constructor."""
    from txl_deploy.exporters.onnx.ort_format import write_ort_format
    from txl_deploy.runtimes import TxlRuntime

    shutil.copy(tiny_onnx, tmp_path / "model.onnx")
    blob = write_ort_format(tmp_path / "model.onnx").path.read_bytes()
    name = b"\x06\x00\x00\x00tokens"  # a flatbuffer string: its length, then its bytes
    at = blob.rindex(name)  # the last copy: the graph's list of input names
    (tmp_path / "model.ort").write_bytes(blob[:at] + b"\x06\x00\x00\x00\x80okens" + blob[at + len(name):])
    with pytest.raises(CheckpointError, match="model.ort"):
        TxlRuntime.load(tmp_path / "model.ort")


def test_a_midi_header_claiming_gigabytes_is_refused_without_allocating_them(tmp_path):
    """mido reads each chunk with the size its header claims; from a file object that read allocated the claimed
    4 GB whole (MemoryError in the fuzz worker, whose address space has 512 MB to spare)."""
    path = tmp_path / "song.mid"
    path.write_bytes(b"MThd\xff\x00\x00\x06\x00\x01\x00\x02\x01\xe0MTrk\x00\x00\x00\x04\x00\xff\x2f\x00")
    code = textwrap.dedent("""
        import resource, sys
        from txl_deploy.errors import InputError
        from txl_deploy.music.midi_to_events import midi_to_events
        import mido  # noqa: F401  (before the limit, as the fuzz worker does)
        vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
        try:
            midi_to_events(sys.argv[1])
        except InputError as e:
            print("refused:", e)
    """)
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("refused:") and "not a readable MIDI file" in r.stdout, r.stderr
