"""Mapping a foreign state_dict onto our parameter names: one rule table per source format, applied generically.

A rule is `(pattern, target, transform)`: `pattern` is matched against the whole source key, `target` is the
`re` expansion template of our key (None drops the tensor: buffers we recompute, aliases of tied weights) and
`transform` (or None) rewrites the tensor, e.g. reversing HuggingFace's cluster rows. A key no rule matches is an
error naming the key, so a checkpoint of some other architecture never loads half-way.

After renaming, `normalise` brings the tensors in line with the config: one shared `r_w_bias`/`r_r_bias` pair
when `untie_r` is false, and tied parameters (`tie_weight`, `tie_projs`) stored once.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

from txl_deploy.errors import CheckpointError


class Rule(NamedTuple):
    pattern: str
    target: str | None
    transform: Callable | None = None


def same_tensor(a, b) -> bool:
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    return a is b or (tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and torch.equal(a, b))


def rename(state_dict: dict, rules: list[Rule], path, source: str) -> dict:
    """Apply a rule table to every key of `state_dict`; names that map to one key must hold equal tensors."""
    compiled = [(re.compile(r.pattern), r.target, r.transform) for r in rules]
    out: dict = {}
    for key, tensor in state_dict.items():
        if not isinstance(key, str):  # a pickle may key a dict by anything
            raise CheckpointError(path, f"holds a tensor under {repr(key)[:40]}, not a parameter's name")
        for pattern, target, transform in compiled:
            m = pattern.fullmatch(key)
            if m:
                break
        else:
            raise CheckpointError(path, f"tensor {key!r} is not part of a {source} Transformer-XL "
                                        "(attn_type 0) checkpoint")
        if target is None:
            continue
        name = m.expand(target)
        value = transform(tensor) if transform is not None else tensor
        if name in out:
            if not same_tensor(out[name], value):
                raise CheckpointError(path, f"tensors mapping to {name!r} disagree (second one: {key!r})")
            continue
        out[name] = value
    return out


def strip_prefix(state_dict: dict, prefix: str) -> dict:
    """Drop a prefix every key carries (`module.` from DataParallel)."""
    if state_dict and all(isinstance(k, str) and k.startswith(prefix) for k in state_dict):
        return {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def tied_pairs(cfg) -> list[tuple[str, str]]:
    """(alias, source) names of the parameters our model ties (as `MemTransformerLM._tie` does), no torch needed."""
    pairs = []
    n_out = 1 if cfg.div_val == 1 else cfg.n_clusters + 1
    if cfg.tie_weight:
        pairs += [(f"crit.out_layers.{i}.weight", f"word_emb.emb_layers.{i}.weight") for i in range(n_out)]
    for i, tie in enumerate(cfg.tie_projs):
        if tie and cfg.div_val == 1 and cfg.d_model != cfg.d_embed:
            pairs.append((f"crit.out_projs.{i}", "word_emb.emb_projs.0"))
        elif tie and cfg.div_val != 1:
            pairs.append((f"crit.out_projs.{i}", f"word_emb.emb_projs.{i}"))
    return pairs


def infer_ties(state: dict, cutoffs, div_val: int, d_model: int, d_embed: int) -> tuple[bool, list[bool]]:
    """Tie flags for a checkpoint that does not record them (the original code keeps no `tie_weight` attribute).

    An output tensor equal to its embedding counterpart (or absent, i.e. stored once) is taken as tied; tying
    equal tensors cannot change what the model computes.
    """
    n_clusters = len(cutoffs)
    n_out = 1 if div_val == 1 else n_clusters + 1

    def tied(alias, source):
        if alias not in state:
            return source in state
        return source in state and same_tensor(state[alias], state[source])

    tie_weight = all(tied(f"crit.out_layers.{i}.weight", f"word_emb.emb_layers.{i}.weight") for i in range(n_out))
    tie_projs = []
    for i in range(n_clusters + 1):
        if div_val == 1 and d_model == d_embed:
            tie_projs.append(False)  # no projections at all
        else:
            tie_projs.append(tied(f"crit.out_projs.{i}", "word_emb.emb_projs.0" if div_val == 1
                                  else f"word_emb.emb_projs.{i}"))
    return tie_weight, tie_projs


def normalise(state: dict, cfg, path) -> dict:
    """Shared r-biases folded into one pair (untie_r false) and tied aliases dropped (kept if they differ, so
    that `build_model` reports the contradiction)."""
    state = dict(state)
    if not cfg.untie_r:
        for bias in ("r_w_bias", "r_r_bias"):
            per_layer = sorted((k for k in state if re.fullmatch(rf"layers\.\d+\.dec_attn\.{bias}", k)),
                               key=lambda k: int(k.split(".")[1]))
            values = ([state[bias]] if bias in state else []) + [state[k] for k in per_layer]
            if not per_layer:
                continue
            if not all(same_tensor(values[0], v) for v in values[1:]):
                raise CheckpointError(path, f"{bias} differs between layers, but the config shares one pair "
                                            "(untie_r is false)")
            state[bias] = values[0]
            for k in per_layer:
                del state[k]
    for alias, source in tied_pairs(cfg):
        if alias in state and source not in state:
            state[source] = state.pop(alias)
        elif alias in state and same_tensor(state[alias], state[source]):
            del state[alias]
    return state
