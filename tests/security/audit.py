"""Which files Python opens during a call, by path and by inode (a Python audit hook), for tests that assert a
file outside a model's folder is never read. Libraries' native code (ONNX Runtime, TensorRT) is not seen: the
tests check that the refusal happens before any of them is handed the model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_opened: list[str] | None = None


def _audit(event, args):
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # a hook cannot be removed: it records only while a Watch is active


class Watch:
    """Records every file Python opens while active; `touched(path)` says whether `path` was among them."""

    def __enter__(self):
        global _opened
        _opened = []
        return self

    def __exit__(self, *exc):
        global _opened
        self.paths, _opened = _opened, None

    def touched(self, secret: Path) -> bool:
        st = secret.stat()
        for p in self.paths:
            try:
                s = os.stat(p)
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                return True
        return False
