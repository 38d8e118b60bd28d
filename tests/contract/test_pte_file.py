"""The .pte sidecar as written and read back, without an export: round trip, and untrusted sizes refused before
anything is read."""

from __future__ import annotations

import pytest
from helpers.tiny import TINY, TINY_VOCAB

from txl_deploy.config import TxlConfig
from txl_deploy.contract import pte_file
from txl_deploy.contract.metadata import ExportInfo
from txl_deploy.errors import CheckpointError
from txl_deploy.vocab import Vocab


def _written(tmp_path, precision="int4"):
    pte = tmp_path / "m.pte"
    pte.write_bytes(b"\0\0\0\0ET12" + bytes(range(256)))
    export = {"mem_len": 12, "max_segment": 16, "precision": precision, "state": "incremental"}
    info = ExportInfo(TxlConfig(**TINY), Vocab(TINY_VOCAB), export, {"passed": True})
    pte_file.write_sidecar(info, pte, pte_file.sidecar_path(pte))
    return pte


def test_round_trip(tmp_path):
    info = pte_file.read_pte_info(_written(tmp_path))
    assert info.config == TxlConfig(**TINY) and list(info.vocab.symbols) == TINY_VOCAB
    assert (info.mem_len, info.max_segment, info.precision, info.verification) == (12, 16, "int4", {"passed": True})
    assert info.spec().input_names()[:3] == ["tokens", "out_positions", "mem_k.0"]


def test_oversized_sidecar_is_refused_before_reading(tmp_path, monkeypatch):
    pte = _written(tmp_path)
    monkeypatch.setattr(pte_file, "MAX_SIDECAR_BYTES", 1000)
    with pytest.raises(CheckpointError, match="sidecar too large"):
        pte_file.read_pte_info(pte)


def test_newer_format_and_missing_program_are_one_line_errors(tmp_path):
    pte = _written(tmp_path)
    side = pte_file.sidecar_path(pte)
    side.write_text(side.read_text().replace('"format_version": 1', '"format_version": 9'))
    with pytest.raises(CheckpointError, match="newer txl-deploy"):
        pte_file.read_pte_info(pte)
    with pytest.raises(CheckpointError, match="file not found"):
        pte_file.read_pte_info(tmp_path / "absent.pte")
