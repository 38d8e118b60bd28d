"""Putting a state_dict into the reference model, with shape checks that name the file and the tensor."""

from __future__ import annotations

from ..errors import CheckpointError


def build_model(config, state_dict, path="<memory>"):
    import torch

    from ..model import MemTransformerLM

    model = MemTransformerLM(config)
    expected = model.state_dict()
    tied = model.tied_keys()
    unexpected = sorted(k for k in state_dict if k not in expected)
    if unexpected:
        raise CheckpointError(path, f"tensor {unexpected[0]!r} is not part of a model with this config"
                                    + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    missing = sorted(k for k in expected if k not in state_dict and k not in tied)
    if missing:
        raise CheckpointError(path, f"tensor {missing[0]!r} is missing"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for k, v in state_dict.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(path, f"tensor {k!r} has shape {tuple(v.shape)} but the config implies "
                                        f"{tuple(expected[k].shape)}")
    with torch.no_grad():
        # Tied parameters alias one tensor; load the ones present, then re-tie so aliases follow.
        for k, v in state_dict.items():
            if k not in tied:
                expected[k].copy_(v.to(expected[k].dtype))
        for k in tied:
            if k in state_dict and not torch.equal(state_dict[k].to(expected[k].dtype), expected[k]):
                raise CheckpointError(path, f"tensor {k!r} should be tied to its embedding but differs from it")
    return model.eval()


def weights_sha256(state_dict) -> str:
    """Content hash of a state_dict (names and bytes): identifies the weights behind an export or a saved state."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
