"""Transformer-XL (Dai et al. 2019, attn_type 0) in PyTorch: the reference every exported artefact is checked against.

One file to hold against the paper and the original code (kimiyoung/transformer-xl, `mem_transformer.py`).
Parameter names are the original's, so an original `model.pt` maps onto this module key for key.

Differences from the original, all of them deliberate:
- batch-first: tokens are `[B, Q]`, each layer's memory is `[B, mlen, d_model]`;
- inference only: no dropout, no targets; the forward returns log-probabilities `[B, Q, V]`;
- masks come from index comparisons and the adaptive embedding uses a masked gather, so the module traces
  without data-dependent branches (the original's `nonzero()` drops clusters absent from a traced example).

Memory semantics are the paper's: the memory starts empty, layer i caches its own input, it is bounded by
`mem_len`, and no gradient flows into it. A config with `mem_init` "zeros" (REMI) starts it as mem_len zero hidden
states instead, attended like any other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from txl_deploy.config import TxlConfig
from txl_deploy.contract.clusters import Clusters, pieces
from txl_deploy.contract.ring import initial_mem_count


def default_inv_freq(d_model: int, device=None) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, device=device) / d_model))


def sinusoid(pos_seq: torch.Tensor, d_model: int, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """The original PositionalEmbedding: [sin | cos] of position x inverse frequency."""
    if inv_freq is None:
        inv_freq = default_inv_freq(d_model, device=pos_seq.device)
    sinusoid_inp = pos_seq[:, None].float() * inv_freq.float()[None, :]
    return torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)


class PositionalEmbedding(nn.Module):
    """Holds `inv_freq` as a (persistent) buffer, as the original does: a checkpoint saved in fp16 stores it
    rounded, the model was trained and evaluated with the rounded values, so loading uses them as stored."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("inv_freq", default_inv_freq(d_model))

    def forward(self, pos_seq):
        return sinusoid(pos_seq, self.d_model, self.inv_freq)


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """Relative positional attention with the learnable global biases u (r_w_bias) and v (r_r_bias)."""

    def __init__(self, cfg: TxlConfig):
        super().__init__()
        self.n_head, self.d_head, self.pre_lnorm = cfg.n_head, cfg.d_head, cfg.pre_lnorm
        self.qkv_net = nn.Linear(cfg.d_model, 3 * cfg.n_head * cfg.d_head, bias=False)
        self.o_net = nn.Linear(cfg.n_head * cfg.d_head, cfg.d_model, bias=False)
        self.r_net = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)
        self.scale = 1.0 / math.sqrt(cfg.d_head)
        if cfg.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))

    def forward(self, h, mem, pos_emb, r_w_bias, r_r_bias, attn_mask):
        # h [B, Q, D]; mem [B, M, D]; pos_emb [K, D] for distances K-1 ... 0; attn_mask [Q, K] (True = masked)
        B, Q, _ = h.shape
        cat = torch.cat([mem, h], dim=1)
        K = cat.shape[1]
        w_heads = self.qkv_net(self.layer_norm(cat) if self.pre_lnorm else cat)
        q, k, v = torch.chunk(w_heads, 3, dim=-1)
        q = q[:, -Q:].view(B, Q, self.n_head, self.d_head)
        k = k.view(B, K, self.n_head, self.d_head)
        v = v.view(B, K, self.n_head, self.d_head)
        r_k = self.r_net(pos_emb).view(K, self.n_head, self.d_head)

        ac = torch.einsum("bind,bjnd->bnij", q + r_w_bias, k)
        bd = self._rel_shift(torch.einsum("bind,jnd->bnij", q + r_r_bias, r_k))
        score = (ac + bd) * self.scale
        score = score.masked_fill(attn_mask[None, None], float("-inf"))
        prob = F.softmax(score, dim=-1)
        attn_vec = torch.einsum("bnij,bjnd->bind", prob, v).reshape(B, Q, self.n_head * self.d_head)
        out = self.o_net(attn_vec)
        return h + out if self.pre_lnorm else self.layer_norm(h + out)

    @staticmethod
    def _rel_shift(x):
        # The original trick: after it, entry (i, j) holds the score for distance (K - Q + i) - j, i.e. key j
        # seen from query i, given pos_emb for distances K-1 ... 0. Entries for j > i + mlen are garbage and masked.
        B, N, Q, K = x.shape
        x = F.pad(x, (1, 0))  # zero column in front
        x = x.view(B, N, K + 1, Q)[:, :, 1:]
        return x.reshape(B, N, Q, K)


class PositionwiseFF(nn.Module):
    def __init__(self, cfg: TxlConfig):
        super().__init__()
        self.pre_lnorm = cfg.pre_lnorm
        # Indices 0 and 3 as in the original Sequential(Linear, ReLU, Dropout, Linear, Dropout); REMI's second
        # layer has a ReLU too (ff_out_relu), a module without weights, so the keys stay the same.
        self.CoreNet = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_inner), nn.ReLU(), nn.Identity(), nn.Linear(cfg.d_inner, cfg.d_model),
            nn.ReLU() if cfg.ff_out_relu else nn.Identity(),
        )
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)

    def forward(self, x):
        if self.pre_lnorm:
            return x + self.CoreNet(self.layer_norm(x))
        return self.layer_norm(x + self.CoreNet(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TxlConfig):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(cfg)
        self.pos_ff = PositionwiseFF(cfg)

    def forward(self, h, mem, pos_emb, r_w_bias, r_r_bias, attn_mask):
        return self.pos_ff(self.dec_attn(h, mem, pos_emb, r_w_bias, r_r_bias, attn_mask))


class AdaptiveEmbedding(nn.Module):
    """Adaptive input (Baevski & Auli): cluster i embeds in d_embed // div_val**i and projects to d_model."""

    def __init__(self, cfg: TxlConfig):
        super().__init__()
        self.cfg = cfg
        self.emb_scale = cfg.d_model**0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if cfg.div_val == 1:
            self.emb_layers.append(nn.Embedding(cfg.n_token, cfg.d_embed))
            if cfg.d_model != cfg.d_embed:
                self.emb_projs.append(nn.Parameter(torch.zeros(cfg.d_model, cfg.d_embed)))
        else:
            for i, (lo, hi) in enumerate(pieces(cfg.cutoffs, cfg.n_token)):
                d_emb_i = cfg.d_embed // cfg.div_val**i
                self.emb_layers.append(nn.Embedding(hi - lo, d_emb_i))
                self.emb_projs.append(nn.Parameter(torch.zeros(cfg.d_model, d_emb_i)))

    def forward(self, tokens):
        if self.cfg.div_val == 1:
            emb = self.emb_layers[0](tokens)
            if len(self.emb_projs):
                emb = F.linear(emb, self.emb_projs[0])
        else:
            # Masked gather over every cluster instead of the original's nonzero()/index_copy: same values,
            # no data-dependent shapes, every cluster present in a traced graph.
            emb = 0
            bounds = pieces(self.cfg.cutoffs, self.cfg.n_token)
            for (lo, hi), layer, proj in zip(bounds, self.emb_layers, self.emb_projs):
                in_cluster = (tokens >= lo) & (tokens < hi)
                emb_i = F.linear(layer((tokens - lo).clamp(0, hi - lo - 1)), proj)
                emb = emb + torch.where(in_cluster[..., None], emb_i, torch.zeros_like(emb_i))
        return emb * self.emb_scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """The original output layer, returning the full log-distribution instead of the NLL of targets.

    Cluster order: the head holds the shortlist followed by one logit per tail cluster, and (as in the original
    PyTorch code and NVIDIA's) tail cluster i reads the head column `-i`, i.e. the cluster rows are stored in
    reverse. HuggingFace and the TF code read `cutoffs[0] + i - 1`; their checkpoints are converted to this order
    on import by reversing `cluster_weight` / `cluster_bias` rows.
    """

    def __init__(self, cfg: TxlConfig):
        super().__init__()
        self.cfg = cfg
        d_embed, d_proj = cfg.d_embed, cfg.d_model
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        bounds = pieces(cfg.cutoffs, cfg.n_token)
        if cfg.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.zeros(cfg.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(cfg.n_clusters))
        if cfg.div_val == 1:
            if d_proj != d_embed:
                for _ in bounds:
                    self.out_projs.append(nn.Parameter(torch.zeros(d_proj, d_embed)))
            self.out_layers.append(nn.Linear(d_embed, cfg.n_token))
        else:
            for i, (lo, hi) in enumerate(bounds):
                d_emb_i = d_embed // cfg.div_val**i
                self.out_projs.append(nn.Parameter(torch.zeros(d_proj, d_emb_i)))
                self.out_layers.append(nn.Linear(d_emb_i, hi - lo))

    def cluster_params(self, i):
        """(weight, bias, proj or None) of cluster i, the head (i = 0) without its cluster rows."""
        if self.cfg.div_val == 1:
            lo, hi = pieces(self.cfg.cutoffs, self.cfg.n_token)[i]
            weight, bias = self.out_layers[0].weight[lo:hi], self.out_layers[0].bias[lo:hi]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        proj = self.out_projs[i] if len(self.out_projs) else None
        return weight, bias, proj

    @staticmethod
    def _logit(hidden, weight, bias, proj):
        if proj is not None:
            hidden = hidden @ proj  # the original's F.linear(hidden, proj.t())
        return F.linear(hidden, weight, bias)

    def forward(self, hidden):
        """hidden [..., d_model] -> log-probs [..., n_token]."""
        n_clusters = self.cfg.n_clusters
        weight, bias, proj = self.cluster_params(0)
        if n_clusters == 0:
            return F.log_softmax(self._logit(hidden, weight, bias, proj), dim=-1)
        head_weight = torch.cat([weight, self.cluster_weight], dim=0)
        head_bias = torch.cat([bias, self.cluster_bias], dim=0)
        head_logprob = F.log_softmax(self._logit(hidden, head_weight, head_bias, proj), dim=-1)
        layout = Clusters.of(self.cfg)
        out = [head_logprob[..., :layout.shortlist]]
        for i in range(1, n_clusters + 1):
            tail_logprob = F.log_softmax(self._logit(hidden, *self.cluster_params(i)), dim=-1)
            cluster_col = layout.head_column(i)  # head column -i: the original cluster order
            out.append(tail_logprob + head_logprob[..., cluster_col : cluster_col + 1])
        return torch.cat(out, dim=-1)


class MemTransformerLM(nn.Module):
    def __init__(self, cfg: TxlConfig):
        super().__init__()
        self.cfg = cfg
        self.word_emb = AdaptiveEmbedding(cfg)
        self.pos_emb = PositionalEmbedding(cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        if not cfg.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.crit = ProjectedAdaptiveLogSoftmax(cfg)
        self._tie()

    def _tie(self):
        cfg = self.cfg
        if cfg.tie_weight:
            for i, layer in enumerate(self.crit.out_layers):
                layer.weight = self.word_emb.emb_layers[i].weight
        for i, tie in enumerate(cfg.tie_projs):
            if not tie:
                continue
            if cfg.div_val == 1 and cfg.d_model != cfg.d_embed:
                self.crit.out_projs[i] = self.word_emb.emb_projs[0]
            elif cfg.div_val != 1:
                self.crit.out_projs[i] = self.word_emb.emb_projs[i]

    def reset_length(self, mem_len: int):
        """Use another memory length (as the original eval.py does); relative positions allow any length."""
        self.cfg = self.cfg.replace(mem_len=int(mem_len))
        return self

    def tied_keys(self) -> set[str]:
        """state_dict keys that alias another parameter (omitted from our own checkpoint format)."""
        seen, tied = {}, set()
        for name, tensor in self.state_dict(keep_vars=True).items():
            key = id(tensor)
            if key in seen:
                tied.add(name)
            else:
                seen[key] = name
        return tied

    def layer_biases(self, i):
        if self.cfg.untie_r:
            attn = self.layers[i].dec_attn
            return attn.r_w_bias, attn.r_r_bias
        return self.r_w_bias, self.r_r_bias

    def attn_mask(self, qlen: int, mlen: int, device=None) -> torch.Tensor:
        """[Q, K] bool, True = masked: the future, and with same_length keys beyond the mem_len window.

        With positions as distances d = mlen + i - j, the original triu(.., 1 + mlen) masks d < 0, and its
        same_length tril(.., -shift) masks d >= mem_len (derived from shift = qlen - (klen - mem_len)).
        """
        i = torch.arange(qlen, device=device)[:, None]
        j = torch.arange(mlen + qlen, device=device)[None, :]
        dist = mlen + i - j
        mask = dist < 0
        if self.cfg.same_length:
            mask = mask | (dist >= self.cfg.mem_len + self.cfg.same_length_extra)
        return mask

    def rel_pos_emb(self, klen: int, device=None) -> torch.Tensor:
        """Sinusoids of the distances klen-1 ... 0 (clamped to clamp_len when > 0)."""
        pos_seq = torch.arange(klen - 1, -1, -1.0, device=device)
        if self.cfg.clamp_len > 0:
            pos_seq = pos_seq.clamp(max=self.cfg.clamp_len)
        return self.pos_emb(pos_seq)

    def init_mems(self, batch_size: int) -> list[torch.Tensor]:
        """A fresh memory: n_layer tensors of `initial_mem_count` zero hidden states (the paper's: length 0)."""
        p = next(self.parameters())
        n = initial_mem_count(self.cfg, self.cfg.mem_len)
        return [p.new_zeros(batch_size, n, self.cfg.d_model) for _ in range(self.cfg.n_layer)]

    def body(self, tokens, mems=None):
        """tokens [B, Q] -> (last hidden [B, Q, d_model], new mems)."""
        B, Q = tokens.shape
        if mems is None:
            mems = self.init_mems(B)
        mlen = mems[0].shape[1]
        h = self.word_emb(tokens)
        pos_emb = self.rel_pos_emb(mlen + Q, device=h.device)
        mask = self.attn_mask(Q, mlen, device=h.device)
        hids = []
        for i, layer in enumerate(self.layers):
            hids.append(h)
            h = layer(h, mems[i], pos_emb, *self.layer_biases(i), mask)
        return h, self.update_mems(hids, mems)

    def update_mems(self, hids, mems):
        # The original's cat([mem, hid])[-mem_len:], detached: gradients stop at the memory.
        mem_len = self.cfg.mem_len
        with torch.no_grad():
            return [torch.cat([m, h], dim=1)[:, max(0, m.shape[1] + h.shape[1] - mem_len):].detach()
                    for m, h in zip(mems, hids)]

    def forward(self, tokens, mems=None):
        """tokens [B, Q] int64, mems None or n_layer x [B, mlen, d_model] -> (log_probs [B, Q, V], new mems)."""
        h, new_mems = self.body(tokens, mems)
        return self.crit(h), new_mems
