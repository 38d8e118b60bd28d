"""The "vanilla" Transformer language model of the paper's Table 9 (benchmarks/paper_table9.py measures it).

Dai et al. (2019), section 4 and Table 9, compare Transformer-XL's evaluation with the vanilla model of Al-Rfou et
al. (2018): a Transformer with absolute positional encodings and no memory, trained on fixed-length segments,
which at evaluation slides a window of L tokens along the text and recomputes the whole window for every token it
predicts. This module is that model, at the size of a Transformer-XL shape (same layers, heads, d_model, d_inner,
vocabulary; no r_net and no r-biases, which only relative positions need):

- token embedding scaled by sqrt(d_model), plus the sinusoidal encoding of the absolute positions 0 .. L-1 (the
  [sin | cos] layout Transformer-XL uses for its distances);
- n_layer post-layer-norm blocks (as Transformer-XL's default): causal multi-head attention without biases
  (qkv_net, o_net), then the position-wise feed-forward network (Linear, ReLU, Linear);
- the output layer tied to the embedding, a log-softmax.

`forward` is what a careful user runs per predicted token: the window's tokens in, the next-token distribution
after the window's last position out. Only that position's distribution is computed, and the last block, whose
other positions feed nothing, attends from the last position only (its keys and values still cover the whole
window). `forward_all` is the plain causal forward at every position, the reference the shortcut is tested
against.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from txl_deploy.model.mem_transformer import sinusoid


@dataclass(frozen=True)
class VanillaConfig:
    n_token: int
    n_layer: int
    n_head: int
    d_model: int
    d_head: int
    d_inner: int
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def like(cls, txl_config) -> "VanillaConfig":
        """The vanilla model of the same size as a Transformer-XL config (a plain softmax over n_token)."""
        c = txl_config
        return cls(c.n_token, c.n_layer, c.n_head, c.d_model, c.d_head, c.d_inner, c.layer_norm_epsilon)

    def to_dict(self) -> dict:
        return asdict(self)


class VanillaBlock(nn.Module):
    def __init__(self, cfg: VanillaConfig):
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.qkv_net = nn.Linear(cfg.d_model, 3 * cfg.n_head * cfg.d_head, bias=False)
        self.o_net = nn.Linear(cfg.n_head * cfg.d_head, cfg.d_model, bias=False)
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_inner), nn.ReLU(), nn.Linear(cfg.d_inner, cfg.d_model))
        self.ff_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)

    def forward(self, h, queries: int):
        """h [B, L, D]: the block's input at every window position; the output at the last `queries` positions."""
        B, L, _ = h.shape
        H, Dh = self.n_head, self.d_head
        w_q, w_kv = self.qkv_net.weight[: H * Dh], self.qkv_net.weight[H * Dh:]
        x = h[:, L - queries:]
        q = F.linear(x, w_q).view(B, queries, H, Dh).transpose(1, 2)  # [B, H, Q, Dh]
        k, v = F.linear(h, w_kv).view(B, L, 2, H, Dh).permute(2, 0, 3, 1, 4)  # 2 x [B, H, L, Dh]
        # query i (window position L - queries + i) sees keys j <= L - queries + i
        i = torch.arange(queries, device=h.device)[:, None] + (L - queries)
        j = torch.arange(L, device=h.device)[None, :]
        score = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(Dh))
        score = score.masked_fill(j > i, float("-inf"))
        vec = (F.softmax(score, dim=-1) @ v).transpose(1, 2).reshape(B, queries, H * Dh)
        x = self.attn_norm(x + self.o_net(vec))
        return self.ff_norm(x + self.ff(x))


class VanillaTransformerLM(nn.Module):
    def __init__(self, cfg: VanillaConfig):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.n_token, cfg.d_model)
        self.layers = nn.ModuleList(VanillaBlock(cfg) for _ in range(cfg.n_layer))
        self.out = nn.Linear(cfg.d_model, cfg.n_token)
        self.out.weight = self.emb.weight  # tied, as Transformer-XL's character models

    def _input(self, tokens):
        L = tokens.shape[1]
        pos = sinusoid(torch.arange(L, device=tokens.device, dtype=torch.float32), self.cfg.d_model)
        return self.emb(tokens) * self.cfg.d_model**0.5 + pos

    def forward(self, tokens):
        """tokens [B, L] (the window) -> log-probs [B, n_token] of the token after its last position."""
        h = self._input(tokens)
        L = tokens.shape[1]
        for layer in self.layers[:-1]:
            h = layer(h, L)
        h = self.layers[-1](h, 1)  # the last block attends from the last position only
        return F.log_softmax(self.out(h[:, -1]), dim=-1)

    def forward_all(self, tokens):
        """tokens [B, L] -> log-probs [B, L, n_token] at every position: the plain causal forward."""
        h = self._input(tokens)
        L = tokens.shape[1]
        for layer in self.layers:
            h = layer(h, L)
        return F.log_softmax(self.out(h), dim=-1)


def random_vanilla(cfg: VanillaConfig, seed: int = 0) -> VanillaTransformerLM:
    """Reproducible random weights drawn like `random_weights.random_model` (normal(0, 0.02), norms at identity):
    speed depends on the shapes, not the values."""
    gen = torch.Generator().manual_seed(seed)
    model = VanillaTransformerLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm.weight" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model

