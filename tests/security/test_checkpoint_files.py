"""Checkpoint files read nothing they should not: a HuggingFace shard index names files of its folder only, torch's
tar format is not read, and a pickle can neither size an allocation nor call a codec."""

from __future__ import annotations

import json

import pytest
from audit import Watch
from crafted_files import Reduce, legacy_torch_file

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.torch_files import torch_load
from txl_deploy.errors import CheckpointError


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "/tmp/model.safetensors", "sub/../../x", ".."])
def test_a_huggingface_shard_index_names_files_of_its_folder_only(tmp_path, shard):
    folder = tmp_path / "hf"
    folder.mkdir()
    outside = tmp_path / "outside" / "model.safetensors"
    outside.parent.mkdir()
    outside.write_bytes(b"\0" * 16)
    (folder / "config.json").write_text(json.dumps({"model_type": "transfo-xl"}))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with Watch() as watch, pytest.raises(CheckpointError, match="is not a file name in the model's folder"):
        load_model(folder)
    assert not watch.touched(outside)


def test_torch_s_tar_format_is_not_read(tmp_path):
    data = bytearray(1024)
    data[257:262] = b"ustar"
    (tmp_path / "old.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tar format of torch before 0.2"):
        torch_load(tmp_path / "old.pt")


@pytest.mark.parametrize("call, problem", [((bytes, (16,)), "only of data"), ((bytearray, (16,)), "only of data"),
                                           ((__import__("codecs").encode, ("x", "zlib_codec")), "is not bytes"),
                                           ((__import__("codecs").encode, (b"x", "latin1")), "is not bytes")])
def test_a_pickle_rebuilds_bytes_from_data_only(tmp_path, call, problem):
    (tmp_path / "m.pt").write_bytes(legacy_torch_file(Reduce(*call), {}))
    with pytest.raises(CheckpointError, match=problem):
        torch_load(tmp_path / "m.pt")
    # what protocol 2 writes for bytes is still read
    (tmp_path / "ok.pt").write_bytes(legacy_torch_file({"b": b"\x00\xffdata", "a": bytearray(b"xy")}, {}))
    assert torch_load(tmp_path / "ok.pt") == {"b": b"\x00\xffdata", "a": bytearray(b"xy")}


def test_a_zip_record_claiming_a_newer_zip_version_is_one_line(tmp_path):
    """zipfile raises NotImplementedError for a record needing a zip version past 6.3 (found by the fuzzer)."""
    from crafted_files import zip_torch_file

    data = bytearray(zip_torch_file({"w": 1}, {}))
    record = data.index(b"PK\x01\x02")  # the central directory's first record: version needed at +6
    data[record + 6:record + 8] = (64).to_bytes(2, "little")
    (tmp_path / "ep_1.pth.tar").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt torch.save archive \(zip file version 6.4\)"):
        torch_load(tmp_path / "ep_1.pth.tar")


def test_a_state_dict_keyed_by_a_number_is_one_line(tmp_path, tiny_ckpt):
    """A pickle may key a dict by anything; a tensor under 7 is not a parameter (found by the fuzzer)."""
    import torch

    torch.save({"r_w_bias": torch.zeros(2, 8), 7: torch.zeros(2)}, tmp_path / "model.pt")
    config = json.loads((tiny_ckpt / "config.json").read_text())["config"]
    with pytest.raises(CheckpointError, match="holds a tensor under 7, not a parameter's name"):
        load_model(tmp_path / "model.pt", config=config)
    torch.save({7: torch.zeros(2), "module.r_w_bias": torch.zeros(2, 8)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="holds a tensor under 7"):
        load_model(tmp_path / "model.pt", config=config)
