"""What a TensorFlow checkpoint's variable shapes determine: the architecture, in tf/train_gpu.py's flag names plus
n_token, cutoffs and tie_projs. A checkpoint stores no hyper-parameters, so this is all the weights say."""

from __future__ import annotations

import re

import numpy as np

from txl_deploy.errors import CheckpointError

# Variables a checkpoint may hold that are not model weights: the step counter, Adam's slots and powers.
IGNORED = re.compile(r"(.*/)?global_step|.*/Adam(_\d+)?|(.*/)?beta[12]_power(_\d+)?|_CHECKPOINTABLE_OBJECT_GRAPH")

# The original variable names below the model scope (`transformer/` in every published checkpoint).
LAYER_VARS = {
    "rel_attn/qkv/kernel", "rel_attn/r/kernel", "rel_attn/o/kernel", "rel_attn/LayerNorm/gamma",
    "rel_attn/LayerNorm/beta", "ff/layer_1/kernel", "ff/layer_1/bias", "ff/layer_2/kernel", "ff/layer_2/bias",
    "ff/LayerNorm/gamma", "ff/LayerNorm/beta",
}
NAME_PATTERNS = [
    re.compile(r"(r_w_bias|r_r_bias)"),
    re.compile(r"layer_(\d+)/(" + "|".join(sorted(LAYER_VARS)) + ")"),
    re.compile(r"adaptive_embed/(lookup_table|proj_W)"),
    re.compile(r"adaptive_embed/cutoff_(\d+)/(lookup_table|proj_W)"),
    re.compile(r"adaptive_softmax/bias"),
    re.compile(r"adaptive_softmax/cutoff_(\d+)/(b|proj)"),
    re.compile(r"adaptive_softmax/cutoff_0/(cluster_W|cluster_b)"),
]


def _model_names(shapes: dict, path) -> tuple[str, dict]:
    """The model scope (`transformer/`) and {name below it: shape} of the weights; other variables are refused."""
    weights = {n: s for n, s in shapes.items() if not IGNORED.fullmatch(n)}
    anchor = next((n for n in sorted(weights) if n.endswith("r_w_bias")), None)
    if anchor is None:
        raise CheckpointError(path, "has no r_w_bias variable: not an original TensorFlow Transformer-XL checkpoint")
    scope = anchor[: -len("r_w_bias")]
    out = {}
    for name in sorted(weights):
        local = name[len(scope):] if name.startswith(scope) else None
        if local is None or not any(p.fullmatch(local) for p in NAME_PATTERNS):
            raise CheckpointError(path, f"variable {name!r} is not part of an original TensorFlow Transformer-XL "
                                        f"(expected names like {scope}layer_0/rel_attn/qkv/kernel)")
        out[local] = tuple(weights[name])
    return scope, out


def infer_architecture(shapes: dict, path="<checkpoint>") -> dict:
    """What the variable shapes determine, in the flag names of tf/train_gpu.py plus n_token, cutoffs, tie_projs.

    `shapes`: {variable name: shape}. Raises CheckpointError naming the first variable that fits no supported
    configuration."""
    scope, v = _model_names(shapes, path)
    full = lambda local: scope + local  # noqa: E731

    def need(local):
        if local not in v:
            raise CheckpointError(path, f"variable {full(local)!r} is missing")
        return v[local]

    def expect(local, shape):
        if need(local) != tuple(shape):
            raise CheckpointError(path, f"variable {full(local)!r} has shape {list(v[local])}, expected "
                                        f"{list(shape)} for the shapes of the other variables")

    layers = sorted({int(m.group(1)) for n in v if (m := re.match(r"layer_(\d+)/", n))})
    if not layers:
        raise CheckpointError(path, f"has no {scope}layer_N variables")
    n_layer = layers[-1] + 1
    rw = need("r_w_bias")
    if len(rw) == 3:
        untie_r, (n_rb, n_head, d_head) = True, rw
        if n_rb != n_layer:
            raise CheckpointError(path, f"variable {full('r_w_bias')!r} has {n_rb} layers of biases, the checkpoint "
                                        f"{n_layer} layers")
    elif len(rw) == 2:
        untie_r, (n_head, d_head) = False, rw
    else:
        raise CheckpointError(path, f"variable {full('r_w_bias')!r} has shape {list(rw)}, expected "
                                    "[n_head, d_head] or [n_layer, n_head, d_head]")
    expect("r_r_bias", rw)
    def matrix(local):
        shape = need(local)
        if len(shape) != 2:
            raise CheckpointError(path, f"variable {full(local)!r} is not a matrix")
        return shape

    d_model, hd = matrix("layer_0/rel_attn/qkv/kernel")[0], n_head * d_head
    d_inner = matrix("layer_0/ff/layer_1/kernel")[-1]
    for i in range(n_layer):
        p = f"layer_{i}/"
        for local, shape in (("rel_attn/qkv/kernel", (d_model, 3 * hd)), ("rel_attn/r/kernel", (d_model, hd)),
                             ("rel_attn/o/kernel", (hd, d_model)), ("ff/layer_1/kernel", (d_model, d_inner)),
                             ("ff/layer_1/bias", (d_inner,)), ("ff/layer_2/kernel", (d_inner, d_model)),
                             ("ff/layer_2/bias", (d_model,)), ("rel_attn/LayerNorm/gamma", (d_model,)),
                             ("rel_attn/LayerNorm/beta", (d_model,)), ("ff/LayerNorm/gamma", (d_model,)),
                             ("ff/LayerNorm/beta", (d_model,))):
            expect(p + local, shape)

    arch = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, d_head=d_head, d_inner=d_inner, untie_r=untie_r)
    if "adaptive_embed/lookup_table" in v:  # div_val 1: one table, one optional projection
        n_token, d_embed = matrix("adaptive_embed/lookup_table")
        has_proj = d_embed != d_model
        if has_proj:
            expect("adaptive_embed/proj_W", (d_embed, d_model))
        elif "adaptive_embed/proj_W" in v:
            raise CheckpointError(path, f"variable {full('adaptive_embed/proj_W')!r} is unexpected: d_embed equals "
                                        "d_model")
        if "adaptive_softmax/bias" in v:
            cutoffs = []
            expect("adaptive_softmax/bias", (n_token,))
        else:
            sizes = _cluster_sizes(v, "adaptive_softmax/cutoff_{}/b", path, scope)
            if sum(sizes) != n_token:
                raise CheckpointError(path, f"the adaptive softmax biases cover {sum(sizes)} tokens, the embedding "
                                            f"{n_token}")
            cutoffs = list(np.cumsum(sizes)[:-1].tolist())
        tie_projs = []
        for i in range(len(cutoffs) + 1):
            proj = f"adaptive_softmax/cutoff_{i}/proj"
            if not cutoffs or proj not in v:
                tie_projs.append(has_proj)  # no cutoffs: the softmax always reuses the embedding's proj_W
            elif not has_proj:
                raise CheckpointError(path, f"variable {full(proj)!r} is unexpected: d_embed equals d_model")
            else:
                expect(proj, (d_embed, d_model))
                tie_projs.append(False)
        arch.update(div_val=1, proj_same_dim=True)
    else:
        sizes = _cluster_sizes(v, "adaptive_embed/cutoff_{}/lookup_table", path, scope, dim=0)
        dims = [matrix(f"adaptive_embed/cutoff_{i}/lookup_table")[1] for i in range(len(sizes))]
        if len(sizes) < 2:
            raise CheckpointError(path, f"variable {full('adaptive_embed/cutoff_0/lookup_table')!r}: an adaptive "
                                        "embedding needs at least two clusters")
        d_embed = dims[0]
        div_val = dims[0] // dims[1] if dims[1] else 0
        for i, d in enumerate(dims):
            if div_val < 1 or d != d_embed // div_val**i:
                raise CheckpointError(path, f"variable {full(f'adaptive_embed/cutoff_{i}/lookup_table')!r} has "
                                            f"width {d}, which fits no div_val (cluster 0: {d_embed}, cluster 1: "
                                            f"{dims[1]})")
        n_token, cutoffs = sum(sizes), list(np.cumsum(sizes)[:-1].tolist())
        proj_same_dim = True
        for i, d in enumerate(dims):
            name = f"adaptive_embed/cutoff_{i}/proj_W"
            if name in v:
                expect(name, (d, d_model))
            elif d == d_model:
                proj_same_dim = False  # the lm1b setting: no projection where none is needed
            else:
                need(name)
        tie_projs = []
        for i, d in enumerate(dims):
            name = f"adaptive_softmax/cutoff_{i}/proj"
            if name in v:
                expect(name, (d, d_model))
                tie_projs.append(False)
            else:
                # Tied to the embedding's proj_W, or (proj_same_dim False, width d_model) no projection on either
                # side: both are the embedding's projection (an identity in the second case).
                tie_projs.append(True)
        arch.update(div_val=div_val, proj_same_dim=proj_same_dim)
        if not proj_same_dim and any(f"adaptive_embed/cutoff_{i}/proj_W" in v and d == d_model
                                     for i, d in enumerate(dims)):
            raise CheckpointError(path, "some clusters of width d_model have a projection and some do not")
    if cutoffs:
        n_c = len(cutoffs)
        expect("adaptive_softmax/cutoff_0/cluster_W", (n_c, d_embed))
        expect("adaptive_softmax/cutoff_0/cluster_b", (n_c,))
        bounds = [0] + cutoffs + [n_token]
        for i in range(n_c + 1):
            expect(f"adaptive_softmax/cutoff_{i}/b", (bounds[i + 1] - bounds[i],))
    for local in v:
        m = re.match(r"(?:adaptive_embed|adaptive_softmax)/cutoff_(\d+)/", local)
        if m and int(m.group(1)) > len(cutoffs):
            raise CheckpointError(path, f"variable {full(local)!r} is beyond the last cluster")
        if not cutoffs and (local.startswith("adaptive_softmax/cutoff_") or local.startswith("adaptive_embed/cutoff_")):
            raise CheckpointError(path, f"variable {full(local)!r} is unexpected in a model without cutoffs")
    arch.update(n_token=n_token, d_embed=d_embed, cutoffs=cutoffs, tie_projs=tie_projs,
                proj_share_all_but_first=bool(tie_projs[1:]) and all(tie_projs[1:]))
    arch["_scope"] = scope
    return arch


def _cluster_sizes(v, template, path, scope, dim=0) -> list[int]:
    sizes, i = [], 0
    while template.format(i) in v:
        if len(v[template.format(i)]) <= dim:
            raise CheckpointError(path, f"variable {scope}{template.format(i)!r} has shape "
                                        f"{list(v[template.format(i)])}")
        sizes.append(v[template.format(i)][dim])
        i += 1
    if not sizes:
        raise CheckpointError(path, f"variable {scope}{template.format(0)!r} is missing")
    return sizes
