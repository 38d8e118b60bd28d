"""How many times a test's files are read: a file's text or bytes, or a torch.save file unpickled (through the
checkpoint readers' `Source`), counted by file name."""

from __future__ import annotations

import collections
from pathlib import Path

from txl_deploy.checkpoints import reader


def count_reads(monkeypatch) -> collections.Counter:
    """A Counter {file name: reads} that grows as files are read, until the test ends."""
    counts = collections.Counter()
    read_text, read_bytes, torch_load = Path.read_text, Path.read_bytes, reader.torch_load

    def counted_read_text(self, *args, **kwargs):
        counts[self.name] += 1
        return read_text(self, *args, **kwargs)

    def counted_read_bytes(self):
        counts[self.name] += 1
        return read_bytes(self)

    def counted_torch_load(path):
        counts[Path(path).name] += 1
        return torch_load(path)

    monkeypatch.setattr(Path, "read_text", counted_read_text)
    monkeypatch.setattr(Path, "read_bytes", counted_read_bytes)
    monkeypatch.setattr(reader, "torch_load", counted_torch_load)
    return counts
