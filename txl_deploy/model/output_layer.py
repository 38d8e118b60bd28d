"""The adaptive embedding and adaptive softmax of a `MemTransformerLM`, each weight held once in the layout it is read.

A batch-1 decode step reads every weight once, and the output layer is most of them (440 MB of the WikiText-103
base model's 604 MB). `ProjectedAdaptiveLogSoftmax` reads its weight as `F.linear` does, [rows, d_emb], so a
traced graph holds it in that layout and reaches each cluster through `Slice -> Transpose -> MatMul`. ONNX Runtime
constant-folds those into new, transposed constants at load, and since the tied embedding's `Gather` still reads
the original, the largest tensor of the model is held twice.

Here every cluster's output weight is one tensor [d_emb_i, hi - lo], the layout a MatMul `hidden @ W` reads as
its B, and the head's cluster rows are stored as its last columns (one MatMul, one bias, no Concat). When the
weights are tied the embedding reads those same tensors with a Gather on axis 1 (a token's embedding is a column),
so nothing in the graph is sliced, transposed or folded at load. Projections keep their stored layout
[d_model, d_emb_i]: the output reads them as `hidden @ proj` (the original's `F.linear(hidden, proj.t())`) and the
embedding as `proj @ columns`, so a tied projection is one tensor as well.

Same numbers as `AdaptiveEmbedding` and `ProjectedAdaptiveLogSoftmax`; `head`, `tail` and `forward` are one
composition, so a graph traced from the parts and the full graph compute identical log-probs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from txl_deploy.contract.clusters import Clusters, pieces
from txl_deploy.model.mem_transformer import MemTransformerLM


class OutputLayer(nn.Module):
    """Adaptive input and adaptive softmax over shared, consumer-layout weights.

    Buffers: `out_weight_{i}` [d_emb_i, hi - lo] (the head's with n_clusters more columns: the cluster logits, in
    the stored order, tail cluster i at column `layout.head_column(i)`), `out_bias_{i}`, `proj_{k}` [d_model,
    d_emb] (one per distinct projection, tied ones once) and, untied only, `emb_weight_{i}` [rows, d_emb_i] as
    nn.Embedding holds it.
    """

    def __init__(self, model: MemTransformerLM):
        super().__init__()
        cfg = model.cfg
        emb, crit = model.word_emb, model.crit
        self.cfg = cfg
        self.emb_scale = cfg.d_model**0.5
        self.n_clusters = cfg.n_clusters
        self.layout = Clusters.of(cfg)  # None for a plain softmax
        all_bounds = pieces(cfg.cutoffs, cfg.n_token)
        # Buffer names by source parameter: a projection that the embedding and the output share is registered
        # once and looked up by name, so `.to()`/`.half()` (which convert buffers one by one) keep it shared.
        self._proj_names: dict[int, str] = {}

        with torch.no_grad():
            self.out_proj_names = []
            for i in range(cfg.n_clusters + 1):
                weight, bias, proj = crit.cluster_params(i)
                if i == 0 and cfg.n_clusters > 0:
                    weight = torch.cat([weight, crit.cluster_weight], dim=0)
                    bias = torch.cat([bias, crit.cluster_bias], dim=0)
                self.register_buffer(f"out_weight_{i}", weight.detach().t().contiguous(), persistent=False)
                self.register_buffer(f"out_bias_{i}", bias.detach().clone(), persistent=False)
                self.out_proj_names.append(self._hold_proj(proj))

            # The embedding as pieces: (lo, hi, source buffer, source is [d_emb, rows] (tied), projection or None).
            # div_val 1 projects once after the pieces are summed, div_val > 1 projects each piece.
            self.emb_pieces = []
            if cfg.div_val == 1:
                self.emb_proj_name = self._hold_proj(emb.emb_projs[0] if len(emb.emb_projs) else None)
                if cfg.tie_weight:
                    for i, (lo, hi) in enumerate(all_bounds):
                        self.emb_pieces.append((lo, hi, f"out_weight_{i}", True, None))
                else:
                    self.register_buffer("emb_weight_0", emb.emb_layers[0].weight.detach().clone(), persistent=False)
                    self.emb_pieces.append((0, cfg.n_token, "emb_weight_0", False, None))
            else:
                self.emb_proj_name = None
                for i, (lo, hi) in enumerate(all_bounds):
                    proj_name = self._hold_proj(emb.emb_projs[i])
                    if cfg.tie_weight:
                        self.emb_pieces.append((lo, hi, f"out_weight_{i}", True, proj_name))
                    else:
                        self.register_buffer(f"emb_weight_{i}", emb.emb_layers[i].weight.detach().clone(),
                                             persistent=False)
                        self.emb_pieces.append((lo, hi, f"emb_weight_{i}", False, proj_name))

    def _hold_proj(self, proj):
        if proj is None:
            return None
        key = id(proj)
        if key not in self._proj_names:
            name = f"proj_{len(self._proj_names)}"
            self.register_buffer(name, proj.detach().clone(), persistent=False)
            self._proj_names[key] = name
        return self._proj_names[key]

    # -- input -------------------------------------------------------------------------------------------------
    def embed(self, tokens, scaled: bool = True):
        """tokens [B, Q] -> [B, Q, d_model], scaled by sqrt(d_model) as AdaptiveEmbedding (`scaled=False`: for a
        caller that folds the scale into what reads it)."""
        B, Q = tokens.shape
        flat = tokens.reshape(B * Q)
        single = len(self.emb_pieces) == 1
        emb = 0
        for lo, hi, source, columns, proj_name in self.emb_pieces:
            table = getattr(self, source)
            # Masked gather over every piece, as AdaptiveEmbedding: no data-dependent shapes in a traced graph.
            idx = flat if single else (flat - lo).clamp(0, hi - lo - 1)
            if columns:
                cols = torch.index_select(table, 1, idx)  # [d_emb, N]: Gather on axis 1 of the output's layout
            else:
                cols = F.embedding(idx, table).t()  # rows [N, d_emb], transposed as an activation
            if proj_name is not None:
                cols = getattr(self, proj_name) @ cols  # [d_model, N]: the projection in its stored layout
            if single:
                emb = cols
            else:
                in_piece = (flat >= lo) & (flat < hi)
                emb = emb + torch.where(in_piece[None, :], cols, torch.zeros_like(cols))
        if self.emb_proj_name is not None:
            emb = getattr(self, self.emb_proj_name) @ emb
        emb = emb.t().reshape(B, Q, -1)
        return emb * self.emb_scale if scaled else emb

    # -- output ------------------------------------------------------------------------------------------------
    def cluster_tensors(self, i):
        """(weight [d_emb_i, columns], bias, projection [d_model, d_emb_i] or None) of cluster i, 0 the head: the
        tensors themselves, not copies, so a module that registers them as its own buffers shares them."""
        proj_name = self.out_proj_names[i]
        return (getattr(self, f"out_weight_{i}"), getattr(self, f"out_bias_{i}"),
                getattr(self, proj_name) if proj_name is not None else None)

    def _logit(self, i, hidden):
        return logit(hidden, *self.cluster_tensors(i))

    def head(self, hidden):
        """hidden [..., d_model] -> the head's log-probs [..., shortlist + n_clusters] (the vocabulary if none)."""
        return F.log_softmax(self._logit(0, hidden), dim=-1)

    def tail(self, i, hidden, head_log_prob):
        """Full log-probs [..., hi - lo] of tail cluster i's tokens (i in 1..n_clusters)."""
        col = self.layout.head_column(i)
        return F.log_softmax(self._logit(i, hidden), dim=-1) + head_log_prob[..., col : col + 1]

    def forward(self, hidden):
        """hidden [..., d_model] -> log-probs [..., n_token]."""
        head_log_prob = self.head(hidden)
        if self.n_clusters == 0:
            return head_log_prob
        out = [head_log_prob[..., : self.layout.shortlist]]
        out += [self.tail(i, hidden, head_log_prob) for i in range(1, self.n_clusters + 1)]
        return torch.cat(out, dim=-1)


def logit(hidden, weight, bias, proj):
    """Cluster logits from `OutputLayer.cluster_tensors`: the one formula the full graph and its parts trace."""
    if proj is not None:
        hidden = hidden @ proj
    return hidden @ weight + bias
