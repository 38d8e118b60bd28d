"""Putting a state_dict into the reference model, with shape checks that name the file and the tensor."""

from __future__ import annotations

import hashlib

from txl_deploy.errors import CheckpointError

# Buffers a checkpoint may leave out: a function of the config, recomputed then. When present they are used as
# stored (a checkpoint saved in fp16 holds inv_freq rounded, and its model ran with the rounded values).
RECOMPUTABLE = {"pos_emb.inv_freq"}


def build_model(config, state_dict, path="<memory>"):
    """The reference model holding `state_dict`'s tensors themselves (no copy when the dtype already matches).

    The module is built on the meta device and the loaded tensors are assigned into it: a 1.1 GB checkpoint then
    costs 1.1 GB, not twice that (random initial weights plus a copy), and tensors memory-mapped from the file
    stay file-backed. The model and the LoadedModel share those tensors, so neither may be modified in place.
    """
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.mem_transformer import MemTransformerLM, default_inv_freq  # imports torch

    with torch.device("meta"):
        model = MemTransformerLM(config)
    expected = model.state_dict()
    tied = model.tied_keys()
    unexpected = sorted(k for k in state_dict if k not in expected)
    if unexpected:
        raise CheckpointError(path, f"tensor {unexpected[0]!r} is not part of a model with this config"
                                    + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    missing = sorted(k for k in expected if k not in state_dict and k not in tied and k not in RECOMPUTABLE)
    if missing:
        raise CheckpointError(path, f"tensor {missing[0]!r} is missing"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for k, v in state_dict.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(path, f"tensor {k!r} has shape {tuple(v.shape)} but the config implies "
                                        f"{tuple(expected[k].shape)}")
    own = {k: v.detach().to(expected[k].dtype).contiguous() for k, v in state_dict.items() if k not in tied}
    if "pos_emb.inv_freq" not in own:
        own["pos_emb.inv_freq"] = default_inv_freq(config.d_model)
    model.load_state_dict(own, strict=False, assign=True)
    model._tie()  # assignment replaced the aliased Parameters: tie them again so aliases follow
    built = model.state_dict()
    left = [k for k, v in built.items() if v.is_meta]
    if left:  # a config whose module holds a tensor that neither the checkpoint nor the formula provides
        raise CheckpointError(path, f"tensor {left[0]!r} is missing")
    with torch.no_grad():
        for k in tied:
            if k in state_dict and not torch.equal(state_dict[k].to(expected[k].dtype), built[k]):
                raise CheckpointError(path, f"tensor {k!r} should be tied to its embedding but differs from it")
    return model.eval()


def stored_inv_freq_note(config, state_dict) -> str | None:
    """A note when the stored positional inv_freq differs from the formula (e.g. rounded by an fp16 save)."""
    from txl_deploy.model.mem_transformer import default_inv_freq  # imports torch

    stored = state_dict.get("pos_emb.inv_freq")
    if stored is None or tuple(stored.shape) != (len(range(0, config.d_model, 2)),):
        return None
    diff = float((stored.float() - default_inv_freq(config.d_model)).abs().max())
    if diff <= 1e-6:  # fp32 values computed elsewhere may differ in the last bit; fp16 rounding is ~1e-4
        return None
    dtype = str(stored.dtype).replace("torch.", "")
    return (f"uses the checkpoint's stored pos_emb.inv_freq ({dtype}), which differs from the recomputed values "
            f"by up to {diff:.2g}: the model was trained and evaluated with the stored ones")


def weights_sha256(state_dict) -> str:
    """Content hash of a state_dict (names and bytes): identifies the weights behind an export or a saved state."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_parameters(model) -> int:
    """The model's parameters as `info`, the exported files' metadata and the README count them: every trained
    tensor (`nn.Parameter`). Buffers and the tables an export precomputes from the config (positional encodings)
    are not parameters."""
    return int(sum(p.numel() for p in model.parameters()))
