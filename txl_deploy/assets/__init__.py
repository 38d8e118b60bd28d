"""Where the bundled demo model and its held-out text live inside the installed package.

The demo model (`txl_deploy/assets/demo/kjv-char/`, our checkpoint format) is a small character-level Transformer-XL
trained on the King James Bible by `examples/train_demo.py`; `assets/demo/heldout.txt` is the held-out part of
that text and `assets/demo/training.json` records how it was trained and what it scores. They ship as package
data (pyproject `[tool.setuptools.package-data]`), so these paths work from a wheel as well as a checkout.
No torch here: the runtime path asks for these paths too.
"""

from __future__ import annotations

import json
from pathlib import Path

from txl_deploy.errors import CheckpointError

DEMO_DIR = Path(__file__).resolve().parent / "demo"


def _existing(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(path, "bundled demo asset is missing (was the package installed without its data?)")
    return path


def demo_model_path() -> Path:
    """The bundled checkpoint folder (config.json, model.safetensors, vocab.json)."""
    return _existing(DEMO_DIR / "kjv-char")


def demo_heldout_path() -> Path:
    """The held-out King James text the demo model was never trained on."""
    return _existing(DEMO_DIR / "heldout.txt")


def demo_training_record() -> dict:
    """training.json: command, seed, steps, losses and the recorded held-out bits per character."""
    return json.loads(_existing(DEMO_DIR / "training.json").read_text(encoding="utf-8"))
