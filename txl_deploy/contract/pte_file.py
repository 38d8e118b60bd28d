"""The ExecuTorch program's sidecar: `<name>.pte.json`, what a `.pte` says about itself.

An ONNX file carries its config, vocabulary and export settings in `metadata_props`; a `.pte` has no such
free-form string table, so they travel in a JSON file beside it, named after it (`model.pte` ->
`model.pte.json`). The `.pte` and its sidecar are enough to run the model. The sidecar holds:

- `format`: "txl-deploy.pte", `format_version`: the io_spec format version it was written with;
- `config`, `vocab` (or null), `export`, `verification` (or null): the same objects as the ONNX metadata entries
  `txl_deploy.config`, `.vocab`, `.export` and `.verification` (see docs/graph-contract.md);
- `pte`: `{"size": bytes, "sha256": hex}` of the program it describes, so a sidecar copied beside another
  `.pte` (another export, another precision) is refused instead of running with the wrong memory layout.

Both files come from wherever the user got them, so reading checks the sidecar's size before reading it, its
types and the program's size and hash, and every problem is one line (CheckpointError). No torch, no executorch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from txl_deploy.contract import io_spec
from txl_deploy.contract.metadata import KEY_CONFIG, KEY_EXPORT, KEY_FORMAT, KEY_VERIFY, KEY_VOCAB, ExportInfo
from txl_deploy.errors import CheckpointError

FORMAT = "txl-deploy.pte"
SUFFIX = ".json"
MAX_SIDECAR_BYTES = 256 << 20  # a word model's vocabulary (267k words) is ~5 MB; anything far larger is not ours
_HASH_CHUNK = 8 << 20


def sidecar_path(pte_path) -> Path:
    """`model.pte` -> `model.pte.json`."""
    pte_path = Path(pte_path)
    return pte_path.with_name(pte_path.name + SUFFIX)


def file_digest(path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def sidecar_json(info: ExportInfo, pte_path) -> str:
    """The sidecar text for `info` describing the program file at `pte_path` (already written)."""
    size, sha = file_digest(pte_path)
    doc = {
        "format": FORMAT,
        "format_version": io_spec.FORMAT_VERSION,
        "config": info.config.to_dict(),
        "vocab": json.loads(info.vocab.to_json()) if info.vocab is not None else None,
        "export": info.export,
        "verification": info.verification,
        "pte": {"size": size, "sha256": sha},
    }
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def write_sidecar(info: ExportInfo, pte_path, out_path) -> None:
    """Write the sidecar for the program at `pte_path` to `out_path` (the caller makes it atomic)."""
    Path(out_path).write_text(sidecar_json(info, pte_path), encoding="utf-8")


def _load_sidecar(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(path.with_name(path.name[: -len(SUFFIX)]),
                              f"no sidecar {path.name} beside it (export writes both; copy them together)")
    size = path.stat().st_size
    if size > MAX_SIDECAR_BYTES:
        raise CheckpointError(path, f"sidecar too large ({size} bytes, at most {MAX_SIDECAR_BYTES})")
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(path, f"not a readable sidecar ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(path, f"not a txl-deploy .pte sidecar (no \"format\": \"{FORMAT}\")")
    return doc


def _check_program(pte_path: Path, sidecar: Path, doc: dict, check_hash: bool) -> None:
    pte = doc.get("pte")
    if not (isinstance(pte, dict) and isinstance(pte.get("size"), int) and not isinstance(pte.get("size"), bool)
            and isinstance(pte.get("sha256"), str) and len(pte["sha256"]) == 64):
        raise CheckpointError(sidecar, "corrupt txl-deploy sidecar (\"pte\" needs an integer size and a sha256)")
    size = pte_path.stat().st_size
    if size != pte["size"]:
        raise CheckpointError(pte_path, f"does not match its sidecar {sidecar.name} ({size} bytes, the sidecar "
                                        f"describes {pte['size']}): copy the .pte and its sidecar together")
    if check_hash and file_digest(pte_path)[1] != pte["sha256"].lower():
        raise CheckpointError(pte_path, f"does not match its sidecar {sidecar.name} (sha256 differs): "
                                        "copy the .pte and its sidecar together")


def read_pte_info(path, *, check_hash: bool = True) -> ExportInfo:
    """ExportInfo of an ExecuTorch program from its sidecar, after checking the sidecar belongs to it.

    `check_hash=False` checks only the size (hashing a 1 GB program takes a few seconds); loaders hash."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    sidecar = sidecar_path(path)
    doc = _load_sidecar(sidecar)
    _check_program(path, sidecar, doc, check_hash)
    for key, kinds in (("config", dict), ("export", dict), ("vocab", (dict, type(None))),
                       ("verification", (dict, type(None)))):
        if not isinstance(doc.get(key), kinds):
            raise CheckpointError(sidecar, f"corrupt txl-deploy sidecar (\"{key}\" missing or not an object)")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(sidecar, "corrupt txl-deploy sidecar (\"format_version\" is not an integer)")
    props = {KEY_FORMAT: str(version), KEY_CONFIG: json.dumps(doc["config"]), KEY_EXPORT: json.dumps(doc["export"])}
    if doc["vocab"] is not None:
        props[KEY_VOCAB] = json.dumps(doc["vocab"])
    if doc["verification"] is not None:
        props[KEY_VERIFY] = json.dumps(doc["verification"])
    info = ExportInfo.from_props(props, sidecar)
    _check_export(info, sidecar)
    return info


def _check_export(info: ExportInfo, sidecar: Path) -> None:
    """Beyond what every reader checks (metadata.check_export_settings): a precision this program format has."""
    if info.precision not in ("fp32", "int8", "int4"):
        raise CheckpointError(sidecar, f"corrupt txl-deploy sidecar (unknown precision {info.precision!r})")
