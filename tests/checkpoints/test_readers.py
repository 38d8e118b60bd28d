"""Detection asks each family's reader in turn (detect.READERS) and every file is read once, however many readers
look at it: a folder's config.json is parsed once, a torch.save file (a published one is up to a gigabyte) is
unpickled once."""

from __future__ import annotations

import json

import pytest
from helpers import remi_xl as rx
from helpers.file_reads import count_reads
from helpers.reference_models import CMU_VARIANTS, save_our_model_as_model_pt

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.detect import READERS
from txl_deploy.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def reads(monkeypatch):
    """File name -> how many times its text or bytes were read or it was unpickled."""
    return count_reads(monkeypatch)


def test_each_file_is_read_once(tiny_ckpt, tmp_path, reads):
    assert load_model(tiny_ckpt).source_format == "txl-deploy"
    assert reads["config.json"] == 1
    # a HuggingFace folder's config.json: looked at by two readers, read by one (here it then lacks its weights)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "transfo-xl"}))
    with pytest.raises(CheckpointError, match="HuggingFace folder without weights"):
        load_model(hf)
    assert reads["config.json"] == 2
    save_our_model_as_model_pt(tmp_path / "model.pt", **CMU_VARIANTS["div2"])
    assert load_model(tmp_path / "model.pt").source_format == "cmu"
    rx.save_pth_tar(tmp_path / "ep_170.pth.tar", rx.state_dict())
    assert load_model(tmp_path / "ep_170.pth.tar").source_format == "remi-xl"  # asked after cmu and nvidia
    assert (reads["model.pt"], reads["ep_170.pth.tar"]) == (1, 1)


def test_every_family_has_one_reader_that_names_it():
    names = [r.name for r in READERS]
    assert len(set(names)) == len(names)
    assert {"txl-deploy", "cmu", "cmu-state-dict", "huggingface", "nvidia", "tensorflow", "remi",
            "remi-xl"} <= set(names)
    assert all(r.family for r in READERS)
