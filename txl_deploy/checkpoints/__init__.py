"""Checkpoint import and export: every published format maps to one `TxlConfig` + a state_dict in our names.

`load_model(path)` detects the format and returns a `LoadedModel`; `path` may be a hub reference
(`hf://OWNER/NAME[@REVISION]`, fetched into or read from the HuggingFace cache, see `hub.py`). Our own format (what `txl-deploy convert`
writes) is a folder: `config.json`, `model.safetensors` (tied parameters stored once) and `vocab.json`.
"""

from txl_deploy.checkpoints.detect import load_any
from txl_deploy.checkpoints.hub import HubReference, fetch_snapshot, is_hub_reference
from txl_deploy.checkpoints.native import LoadedModel, load_ours, save_checkpoint

__all__ = ["LoadedModel", "load_model", "load_ours", "save_checkpoint"]


def load_model(path, **kwargs):
    """Load any supported checkpoint (format detected) into a `LoadedModel`. A hub reference is fetched first
    (its snapshot folder is a HuggingFace folder)."""
    if isinstance(path, HubReference) or is_hub_reference(path):
        path = fetch_snapshot(path)
    return load_any(path, **kwargs)
