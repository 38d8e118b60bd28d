"""The cached formulation of a Transformer-XL step: what the ONNX graph computes, and the fast PyTorch path.

Same numbers as `MemTransformerLM` (the reference), arranged for deployment (see `io_spec` for the I/O):

- The memory is a ring buffer of `mem_len` slots per layer holding the *projected* keys and values of the cached
  hidden states, not the hidden states themselves. They never change once written, so a decode step costs about
  what its weights cost instead of re-projecting mem_len x d_model through `qkv_net` in every layer.
- The positional term is a constant: `r_net(sinusoid(d))` for every distance d the graph can see is precomputed
  per layer (`r_table`, [n_head, d_head, T]); a step multiplies the queries by it once and gathers each
  (query, key) pair's entry by its distance. This replaces the original `rel_shift` with index arithmetic.
- Keys are stored pre-transposed ([B, H, d_head, M]) and the scores against memory and against the current
  segment are computed separately and only then concatenated: attention is plain MatMuls over the per-layer
  buffers, and the memory is never copied (Concat/Split of a whole buffer was a quarter of an early export's step).
- Masks come from index comparisons on the per-row token counter (`mem_count`): slot s of a row that has consumed
  n tokens holds stream position p with p % M == s, its age is (n - 1 - s) mod M, it is valid when age < n, and
  the distance from query i of this segment is i + 1 + age. No data-dependent branch, no zero-size tensor.
- Every weight is stored in the layout its product streams fastest at batch 1. The hidden states stay 2-D
  ([B * Q, d_model]) through the layers, so a Linear is one Gemm with its bias inside. A product that widens
  (qkv_net, the first feed-forward layer) reads its weight as [in, out] (`x @ W`). One that narrows (the second
  feed-forward layer) reads nn.Linear's own [out, in] with transB, where every output is one contiguous dot
  product. ONNX Runtime's one-token kernels stream [in, out] at 21-24 GB/s when out > in and at 14-20 GB/s
  when out < in, and [out, in] the other way round (one thread, weights not in cache; `dense` below).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from txl_deploy.contract import io_spec
from txl_deploy.contract.io_spec import r_table_size
from txl_deploy.contract.ring import initial_mem_count, write_ring
from txl_deploy.model.mem_transformer import MemTransformerLM
from txl_deploy.model.output_layer import OutputLayer


class CachedTxl(nn.Module):
    def __init__(self, model: MemTransformerLM, mem_len: int, state: str = "incremental", max_segment: int = 512):
        super().__init__()
        cfg = model.cfg
        if state not in io_spec.STATE_LAYOUTS:
            raise ValueError(f"state must be one of {io_spec.STATE_LAYOUTS}")
        self.cfg, self.mem_len, self.state, self.max_segment = cfg, int(mem_len), state, int(max_segment)
        self.spec = io_spec.GraphSpec(cfg.n_layer, cfg.n_head, cfg.d_head, self.mem_len, cfg.n_token, state)
        self.layers = model.layers
        # The embedding and the adaptive softmax over one copy of the output weights, stored as the MatMuls read
        # them: a traced graph then holds the tied weight once, with nothing to slice, transpose or fold at load.
        # `crit` is the step's last module, the same object; a caller may replace it to trace the output layer's
        # parts as graphs of their own.
        self.output_layer = OutputLayer(model)
        self.crit = self.output_layer
        # same_length: a query sees only the last mem_len (+1 for NVIDIA's variant) positions.
        self.window = self.mem_len + cfg.same_length_extra if cfg.same_length else None
        self.table_size = r_table_size(cfg.clamp_len, self.mem_len, self.max_segment)
        scale = 1.0 / cfg.d_head**0.5
        p = next(model.parameters())
        # A buffer, not a torch.tensor() per call: a host-to-device copy cannot be captured in a CUDA graph.
        self.register_buffer("neg_inf", torch.tensor(float("-inf"), dtype=p.dtype, device=p.device), persistent=False)
        with torch.no_grad():
            sin = model.pos_emb(torch.arange(self.table_size, dtype=torch.float32, device=p.device))
            for i, layer in enumerate(model.layers):
                r = layer.dec_attn.r_net(sin.to(p.dtype)).view(self.table_size, cfg.n_head, cfg.d_head)
                self.register_buffer(f"r_table_{i}", r.permute(1, 2, 0).contiguous(), persistent=False)
                # The 1/sqrt(d_head) score scale is folded into the query rows of qkv_net and into the biases, so
                # no Mul sits before the score MatMuls: ONNX Runtime fuses such a Mul into a FusedMatMul, which
                # measured 3-4x slower than a plain MatMul on [1, H, 1, d_head] x [1, H, d_head, mem_len].
                qkv = scaled_qkv_weight(layer, cfg)
                if i == 0 and not cfg.pre_lnorm:
                    # The embedding's sqrt(d_model) is folded in too: the first layer's qkv_net reads the unscaled
                    # embedding. A Mul by a scalar in front of a MatMul is fused by ONNX Runtime into a FusedMatMul,
                    # which has no fast one-token kernel (0.34 against 0.10 ms on the WikiText-103 base shape).
                    qkv *= self.output_layer.emb_scale
                self.register_buffer(f"qkv_weight_{i}", qkv.t().contiguous(), persistent=False)  # [in, out]
                r_w_bias, r_r_bias = model.layer_biases(i)
                self.register_buffer(f"r_w_bias_{i}", r_w_bias.detach()[:, None, :] * scale, persistent=False)
                self.register_buffer(f"r_r_bias_{i}", r_r_bias.detach()[:, None, :] * scale, persistent=False)

    def empty_state(self, batch: int, dtype=torch.float32, device=None):
        s = self.spec
        mems = []
        for _ in range(s.n_layer):
            mems.append(torch.zeros(s.k_shape(batch), dtype=dtype, device=device))
            mems.append(torch.zeros(s.v_shape(batch), dtype=dtype, device=device))
        count = initial_mem_count(self.cfg, self.mem_len)  # zero rings: empty, or REMI's attended zero memory
        return mems + [torch.full((batch,), count, dtype=torch.int64, device=device)]

    def forward(self, tokens, out_positions, *state):
        """tokens [B, Q]; out_positions [B, P]; state = mem_k.0, mem_v.0, mem_k.1, ..., mem_count [B] (io_spec order).

        Returns (log_probs [B, P, V], *state outputs in io_spec order).
        """
        cfg, M, T = self.cfg, self.mem_len, self.table_size
        mems, mem_count = state[:-1], state[-1]
        B, Q = tokens.shape
        H, Dh = cfg.n_head, cfg.d_head
        masks = attention_masks(tokens, mem_count, mems[0].shape[-1], M, T, H, self.window)  # shared by all layers

        emb = self.output_layer.embed(tokens, scaled=cfg.pre_lnorm).reshape(B * Q, cfg.d_model)
        h = emb if cfg.pre_lnorm else emb * self.output_layer.emb_scale
        outs = []
        for i, layer in enumerate(self.layers):
            attn = layer.dec_attn
            k_mem, v_mem = mems[2 * i], mems[2 * i + 1]
            if cfg.pre_lnorm:
                x = attn.layer_norm(h)
            else:  # the first layer's qkv_net carries the embedding's scale: it reads the unscaled embedding
                x = emb if i == 0 else h
            qkv = (x @ getattr(self, f"qkv_weight_{i}")).view(B, Q, 3, H, Dh)
            vec, k, v = attend(qkv, k_mem, v_mem, getattr(self, f"r_w_bias_{i}"), getattr(self, f"r_r_bias_{i}"),
                               getattr(self, f"r_table_{i}"), masks, self.neg_inf)
            out = dense(vec.transpose(1, 2).reshape(B * Q, H * Dh), attn.o_net)
            h = h + out if cfg.pre_lnorm else attn.layer_norm(h + out)
            ff = layer.pos_ff
            x = ff.layer_norm(h) if cfg.pre_lnorm else h
            out = dense(F.relu(dense(x, ff.CoreNet[0])), ff.CoreNet[3])
            if cfg.ff_out_relu:  # REMI's second feed-forward layer has a ReLU too
                out = F.relu(out)
            h = h + out if cfg.pre_lnorm else ff.layer_norm(h + out)
            if self.state == "incremental":
                outs += [k, v]
            else:
                outs += list(write_ring(k_mem, v_mem, k, v, mem_count, M, in_place=False))
        if self.state == "full":
            outs.append(mem_count + Q)

        h = h.view(B, Q, cfg.d_model)
        h_out = torch.gather(h, 1, out_positions[:, :, None].expand(B, out_positions.shape[1], cfg.d_model))
        return (self.crit(h_out), *outs)


def attention_masks(tokens, mem_count, slots: int, mem_len: int, table_size: int, n_head: int, window):
    """What each query of the segment `tokens` [B, Q] sees and at which distance, shared by every layer:
    (keep_mem [B, 1, 1, S], keep_cur [1, 1, Q, Q], idx_mem [B, H, Q, S], idx_cur [B, H, Q, Q]), the keep masks and
    the r_table columns (distances, clamped to the table) of the memory's `slots` slots and of the segment.

    S = mem_len normally. An incremental graph also accepts a 1-slot memory for rows that have consumed nothing
    (mem_count 0): a prompt into an empty memory then skips scores against mem_len masked slots (half of a 512-token
    prefill at mem_len 2100). Ages are still taken modulo mem_len, so the slot is masked."""
    B, Q = tokens.shape
    dev, M, T, H, S = tokens.device, mem_len, table_size, n_head, slots
    slot = torch.arange(S, device=dev)
    age = torch.remainder(mem_count, M)[:, None] - 1 - slot[None, :]  # [B, S]
    age = torch.where(age < 0, age + M, age)
    qpos = torch.arange(Q, device=dev)
    d_mem = qpos[None, :, None] + 1 + age[:, None, :]  # [B, Q, S]
    d_cur = qpos[:, None] - qpos[None, :]  # [Q, Q]
    keep_mem = (age < mem_count[:, None])[:, None, :]  # [B, 1, S]: slot written since the last reset
    keep_cur = d_cur >= 0  # causal
    if window is not None:
        keep_mem = keep_mem & (d_mem < window)
        keep_cur = keep_cur & (d_cur < window)
    keep_mem, keep_cur = keep_mem[:, None], keep_cur[None, None]  # [B, 1, 1|Q, S], [1, 1, Q, Q]
    idx_mem = d_mem.clamp(max=T - 1)[:, None].expand(B, H, Q, S)
    idx_cur = d_cur.clamp(0, T - 1)[None, None].expand(B, H, Q, Q)
    return keep_mem, keep_cur, idx_mem, idx_cur


def attend(qkv, k_mem, v_mem, r_w_bias, r_r_bias, r_table, masks, neg_inf):
    """One layer's attention of a segment over [memory | segment]. qkv [B, Q, 3, H, Dh] (queries and biases already
    scaled by 1/sqrt(d_head)), the layer's ring k_mem [B, H, Dh, S] and v_mem [B, H, S, Dh], `masks` from
    attention_masks -> (vec [B, H, Q, Dh], the segment's k [B, H, Dh, Q] and v [B, H, Q, Dh] for the ring)."""
    keep_mem, keep_cur, idx_mem, idx_cur = masks
    q = qkv[:, :, 0].transpose(1, 2)  # [B, H, Q, Dh]
    k = qkv[:, :, 1].permute(0, 2, 3, 1)  # [B, H, Dh, Q]: stored pre-transposed
    v = qkv[:, :, 2].transpose(1, 2)  # [B, H, Q, Dh]
    q_w = q + r_w_bias
    pos = (q + r_r_bias) @ r_table  # [B, H, Q, T]
    s_mem = torch.where(keep_mem, q_w @ k_mem + torch.gather(pos, 3, idx_mem), neg_inf)
    s_cur = torch.where(keep_cur, q_w @ k + torch.gather(pos, 3, idx_cur), neg_inf)
    # The softmax over [memory | segment] in two parts, normalised after the value products: no Concat of the
    # scores and no Slices of the probabilities (copies of [B, H, Q, M] per layer in a prefill).
    # s_cur always keeps the diagonal (distance 0), so `top` is finite.
    top = torch.maximum(s_mem.amax(-1, keepdim=True), s_cur.amax(-1, keepdim=True))
    e_mem, e_cur = torch.exp(s_mem - top), torch.exp(s_cur - top)
    denom = e_mem.sum(-1, keepdim=True) + e_cur.sum(-1, keepdim=True)
    return (e_mem @ v_mem + e_cur @ v) / denom, k, v


def scaled_qkv_weight(layer, cfg):
    """A copy of the layer's qkv_net weight [3 * n_head * d_head, d_model] with the 1/sqrt(d_head) score scale
    folded into its query rows."""
    qkv = layer.dec_attn.qkv_net.weight.detach().clone()
    qkv[: cfg.n_head * cfg.d_head] *= 1.0 / cfg.d_head**0.5
    return qkv


def dense(x, linear: nn.Linear):
    """`linear(x)` for 2-D x, traced as one Gemm (bias inside) reading the weight in the layout its one-token kernel
    streams fastest: nn.Linear's [out, in] with transB when the product narrows (out < in: each output is one
    contiguous dot product), else [in, out] (the exporter folds the transpose into the stored constant)."""
    weight, bias = linear.weight, linear.bias
    if weight.shape[0] < weight.shape[1]:
        return F.linear(x, weight, bias)
    if bias is None:
        return x @ weight.t()
    return torch.addmm(bias, x, weight.t())
