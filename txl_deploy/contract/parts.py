"""The adaptive softmax's head and tails as separate graphs beside the model: names, file layout and metadata.

A word model's adaptive softmax (Grave et al., 2017; Transformer-XL's `ProjectedAdaptiveLogSoftmax`) splits the
vocabulary into a head (the shortlist [0, cutoffs[0]) plus one logit per tail cluster) and `n_clusters` tails; tail
cluster i covers ids [lo_i, hi_i) and log p(t) = log p_head(column of i) + log p_i(t | i). A generator usually needs
only the head and few tails, but ONNX Runtime runs every node of a graph whatever outputs are asked for, so the
parts are graphs of their own:

- `NAME.head.onnx`: the main graph's inputs; outputs `hidden` [B, P, d_model], `head_log_probs`
  [B, P, shortlist + n_clusters] and the main graph's state outputs (same names, same semantics).
- `NAME.tail<i>.onnx` for i = 1..n_clusters: inputs `hidden` [N, d_model] and `head_log_prob` [N] (the head column
  of cluster i); output `log_probs` [N, hi_i - lo_i], the full log-probabilities of the cluster's tokens.

Where the clusters lie and which head column holds each is `contract.clusters.Clusters` (`Parts.layout`). The main
model's metadata (`export.parts`) lists every part's file name (a bare name in
the model's folder) and sha256, so a runtime refuses a part that does not belong to the model. No torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import CheckpointError

HIDDEN = "hidden"
HEAD_LOG_PROBS = "head_log_probs"
HEAD_LOG_PROB = "head_log_prob"
TAIL_LOG_PROBS = "log_probs"
KEY = "parts"  # in the export settings (txl_deploy.export)
_HASH_CHUNK = 1 << 20


def head_name(model_path) -> str:
    return f"{Path(model_path).stem}.head.onnx"


def tail_name(model_path, i: int) -> str:
    return f"{Path(model_path).stem}.tail{i}.onnx"


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Part:
    file: str  # a bare file name in the model's folder
    sha256: str


@dataclass(frozen=True)
class Parts:
    """The part files a model's metadata lists: `head`, `tails[i - 1]` for cluster i, and the clusters' `layout`."""

    head: Part
    tails: tuple[Part, ...]
    layout: Clusters

    def to_dict(self) -> dict:
        return {"head": {"file": self.head.file, "sha256": self.head.sha256},
                "tails": [{"file": t.file, "sha256": t.sha256} for t in self.tails]}

    @classmethod
    def from_export(cls, export: dict, config, path) -> "Parts | None":
        """The parts the export settings list, checked in form (None when there are none). Refuses names that
        are not bare file names: a model may make a runtime read only files in its own folder."""
        entry = export.get(KEY)
        if entry is None:
            return None
        n = config.n_clusters
        try:
            items = [entry["head"]] + list(entry["tails"])
            parts = [Part(str(p["file"]), str(p["sha256"]).lower()) for p in items]
        except (KeyError, TypeError) as e:
            raise CheckpointError(path, f"corrupt txl-deploy metadata (export.parts: {type(e).__name__})") from None
        if len(parts) != n + 1:
            raise CheckpointError(path, f"corrupt txl-deploy metadata (export.parts lists {len(parts) - 1} tails, "
                                        f"the model has {n} clusters)")
        for p in parts:
            if p.file in ("", ".", "..") or Path(p.file).name != p.file or "\\" in p.file:
                raise CheckpointError(path, f"export.parts names {p.file[:80]!r}; a part must be a file in the "
                                            "model's folder")
            if len(p.sha256) != 64 or any(c not in "0123456789abcdef" for c in p.sha256):
                raise CheckpointError(path, "corrupt txl-deploy metadata (export.parts: a sha256 is not 64 hex "
                                            "digits)")
        return cls(parts[0], tuple(parts[1:]), Clusters.of(config))

    def files(self, model_path) -> list[Path]:
        """The parts' paths (head first), each checked: present, a regular file in the model's folder (no link
        leading elsewhere), with the sha256 the model lists."""
        folder = Path(model_path).resolve().parent
        out = []
        for p in (self.head, *self.tails):
            path = folder / p.file
            if not path.is_file():
                raise CheckpointError(path, f"part of {Path(model_path).name} not found")
            if path.resolve().parent != folder:
                raise CheckpointError(path, "a part must lie in its model's folder (it links elsewhere)")
            if sha256(path) != p.sha256:
                raise CheckpointError(path, f"does not belong to {Path(model_path).name} (sha256 differs from "
                                            "the one its metadata lists)")
            out.append(path)
        return out


__all__ = ["HIDDEN", "HEAD_LOG_PROBS", "HEAD_LOG_PROB", "TAIL_LOG_PROBS", "Part", "Parts", "head_name",
           "tail_name", "sha256"]
