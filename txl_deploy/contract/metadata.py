"""What an exported file says about itself: config, vocabulary and export settings (ONNX `metadata_props`).

The ONNX file alone is enough to run: the runtimes rebuild the config, the vocabulary and the memory layout from
these entries. No torch; reading needs only `onnx` (or ONNX Runtime's `custom_metadata_map`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from txl_deploy.config import TxlConfig
from txl_deploy.contract import io_spec
from txl_deploy.contract.onnx_file import read_metadata, unreadable
from txl_deploy.errors import CheckpointError, TxlError
from txl_deploy.vocab import UnknownKindError, Vocab

P = io_spec.META_PREFIX
KEY_FORMAT, KEY_CONFIG, KEY_VOCAB, KEY_EXPORT, KEY_VERIFY = (
    P + "format_version", P + "config", P + "vocab", P + "export", P + "verification")


@dataclass
class ExportInfo:
    config: TxlConfig
    vocab: Vocab | None
    export: dict  # mem_len, state, max_segment, precision, opset, source, versions, ...
    verification: dict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def mem_len(self) -> int:
        return int(self.export["mem_len"])

    @property
    def state(self) -> str:
        return self.export.get("state", "incremental")

    @property
    def max_segment(self) -> int:
        return int(self.export["max_segment"])

    @property
    def precision(self) -> str:
        return self.export.get("precision", "fp32")

    def spec(self) -> io_spec.GraphSpec:
        c = self.config
        return io_spec.GraphSpec(c.n_layer, c.n_head, c.d_head, self.mem_len, c.n_token, self.state)

    def fingerprint(self) -> str:
        """Identifies the weights-independent shape of the state: saved states carry it (see TxlRuntime.load_state)."""
        key = json.dumps({"config": self.config.to_dict(), "mem_len": self.mem_len,
                          "weights": self.export.get("weights_sha256", "")}, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def to_props(self) -> dict[str, str]:
        props = {KEY_FORMAT: str(io_spec.FORMAT_VERSION), KEY_CONFIG: self.config.to_json(),
                 KEY_EXPORT: json.dumps(self.export, sort_keys=True)}
        if self.vocab is not None:
            props[KEY_VOCAB] = self.vocab.to_json()
        if self.verification is not None:
            props[KEY_VERIFY] = json.dumps(self.verification, sort_keys=True)
        return props

    @classmethod
    def from_props(cls, props: dict, path="<model>") -> "ExportInfo":
        if KEY_CONFIG not in props or KEY_EXPORT not in props:
            raise CheckpointError(path, "not exported by txl-deploy (no txl_deploy.config in its metadata); "
                                        "export it with `txl-deploy export CKPT --onnx`")
        try:
            version = int(props.get(KEY_FORMAT, "1"))
            if version > io_spec.FORMAT_VERSION:
                raise CheckpointError(path, f"exported by a newer txl-deploy (format {version}); upgrade txl-deploy")
            config = TxlConfig.from_json(props[KEY_CONFIG])
            vocab = Vocab.from_dict(json.loads(props[KEY_VOCAB])) if KEY_VOCAB in props else None
            export = json.loads(props[KEY_EXPORT])
            verification = json.loads(props[KEY_VERIFY]) if KEY_VERIFY in props else None
        except UnknownKindError as e:  # a newer txl-deploy's vocabulary: say so, never read it as another kind
            raise CheckpointError(path, str(e)) from None
        except (ValueError, KeyError, TypeError, RecursionError, TxlError) as e:  # RecursionError: nested JSON
            raise CheckpointError(path, f"corrupt txl-deploy metadata ({str(e)[:200]})") from None
        check_export_settings(export, path)
        return cls(config, vocab, export, verification)


MAX_LENGTH = 1 << 20  # mem_len and max_segment above this are damage, not a model (the r table alone would be GBs)


def check_export_settings(export, path) -> None:
    """The export settings a runtime sizes its memory and graph inputs from: present, integers in range, a known
    state layout. Checked once here, so no reader meets a missing key or a string where a length belongs."""
    if not isinstance(export, dict):
        raise CheckpointError(path, "corrupt txl-deploy metadata (the export settings are not an object)")
    for key in ("mem_len", "max_segment"):
        value = export.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LENGTH:
            raise CheckpointError(path, f"corrupt txl-deploy metadata (export.{key} must be an integer in "
                                        f"1..{MAX_LENGTH}, got {str(value)[:40]!r})")
    for key in ("state", "precision"):
        if not isinstance(export.get(key, ""), str):
            raise CheckpointError(path, f"corrupt txl-deploy metadata (export.{key} is not a string)")
    if export.get("state", "incremental") not in io_spec.STATE_LAYOUTS:
        raise CheckpointError(path, f"corrupt txl-deploy metadata (unknown state layout {export['state'][:40]!r})")


def read_onnx_info(path) -> ExportInfo:
    """ExportInfo of an ONNX file, with clear errors for files that are not ONNX or not ours.

    Reads the metadata without parsing the weights (`onnx_file.read_metadata`): a single-file 1.1 GB model
    costs milliseconds and no memory here."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        props, has_node = read_metadata(path)
    except Exception as e:  # ValueError from the wire reader, DecodeError from protobuf, OSError
        raise CheckpointError(path, unreadable(e)) from None
    if not has_node:
        raise CheckpointError(path, "not a readable ONNX model (empty graph)")
    return ExportInfo.from_props(props, path)


def set_onnx_props(model, info: ExportInfo):
    """Replace the txl_deploy.* metadata_props of an in-memory onnx.ModelProto."""
    keep = [(p.key, p.value) for p in model.metadata_props if not p.key.startswith(P)]
    del model.metadata_props[:]
    for k, v in keep + sorted(info.to_props().items()):
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
