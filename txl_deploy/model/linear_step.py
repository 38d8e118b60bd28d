"""The cached step with every weight in an `nn.Linear` made once: the form quantizers and ExecuTorch take.

Same numbers as `CachedTxl` (incremental layout, see `io_spec`), arranged for module-level quantization:

- torchao's `quantize_` replaces the weights of `nn.Linear` modules only. `CachedTxl` multiplies by folded
  `qkv_weight_i` buffers with `F.linear`, and its output layer slices `out_layers[0].weight[lo:hi]` and
  concatenates the cluster rows in every call, so a quantizer would leave most of the weights alone and
  `torch.export` would find tensors created inside `forward` (lifted as fake constants). Here each of them is an
  `nn.Linear` built at construction: qkv with the 1/sqrt(d_head) score scale folded into its query rows, the
  output layer's head (shortlist rows followed by the cluster rows) and each tail cluster, and every projection
  (adaptive input and output) as a Linear without bias.
- Every tensor is this module's own copy: tied weights (input embedding and output layer) are untied, so quantizing
  the output layer leaves the embedding table as it is, and the reference model is never modified.
- The embedding tables stay `nn.Embedding` (a gather; quantizers leave them), the precomputed positional tables
  and biases stay buffers.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from txl_deploy.contract.clusters import Clusters, pieces
from txl_deploy.contract.ring import initial_mem_count
from txl_deploy.model.cached_step import CachedTxl, attend, attention_masks, scaled_qkv_weight
from txl_deploy.model.mem_transformer import MemTransformerLM


def _linear(weight, bias=None) -> nn.Linear:
    """An nn.Linear holding copies of `weight` [out, in] (and `bias`)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight = nn.Parameter(weight.detach().clone().contiguous(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone().contiguous(), requires_grad=False)
    return layer


class _Layer(nn.Module):
    def __init__(self, layer, qkv_weight):
        super().__init__()
        attn = layer.dec_attn
        self.qkv = _linear(qkv_weight)
        self.o_net = copy.deepcopy(attn.o_net)
        self.attn_norm = copy.deepcopy(attn.layer_norm)
        core = layer.pos_ff.CoreNet
        self.ff_in, self.ff_out = copy.deepcopy(core[0]), copy.deepcopy(core[3])
        self.ff_norm = copy.deepcopy(layer.pos_ff.layer_norm)


class LinearCachedTxl(nn.Module):
    """The incremental cached step (io_spec order in and out) with its weights in nn.Linear modules."""

    def __init__(self, model: MemTransformerLM, mem_len: int, max_segment: int = 512):
        super().__init__()
        cached = CachedTxl(model, mem_len, state="incremental", max_segment=max_segment)
        self.cfg = model.cfg
        self.mem_len, self.max_segment, self.state = cached.mem_len, cached.max_segment, "incremental"
        self.spec, self.window, self.table_size = cached.spec, cached.window, cached.table_size
        for name, buf in cached.named_buffers(recurse=False):
            if not name.startswith("qkv_weight_"):
                self.register_buffer(name, buf.detach().clone(), persistent=False)
        self.layers = nn.ModuleList(_Layer(layer, scaled_qkv_weight(layer, self.cfg)) for layer in model.layers)
        self._input_layer(model.word_emb)
        self._output_layer(model.crit)

    def _input_layer(self, emb):
        cfg = self.cfg
        self.emb_scale = emb.emb_scale
        self.emb_bounds = [(0, cfg.n_token)] if cfg.div_val == 1 else pieces(cfg.cutoffs, cfg.n_token)
        self.emb_tables = nn.ModuleList(copy.deepcopy(layer) for layer in emb.emb_layers)
        self.emb_projs = nn.ModuleList(_linear(proj) for proj in emb.emb_projs)  # F.linear(emb, proj)

    def _output_layer(self, crit):
        cfg = self.cfg
        self.n_clusters, self.layout = cfg.n_clusters, Clusters.of(cfg)
        clusters = []
        for i in range(cfg.n_clusters + 1):
            weight, bias, proj = crit.cluster_params(i)
            if i == 0 and cfg.n_clusters:
                weight = torch.cat([weight, crit.cluster_weight], dim=0)
                bias = torch.cat([bias, crit.cluster_bias], dim=0)
            # `hidden @ proj` of the reference is a Linear whose weight is proj transposed
            clusters.append((_linear(weight, bias), None if proj is None else _linear(proj.t())))
        self.out_logits = nn.ModuleList(logits for logits, _ in clusters)
        self.out_projs = nn.ModuleList(proj for _, proj in clusters if proj is not None)
        self.has_out_projs = len(self.out_projs) > 0

    def empty_state(self, batch: int, dtype=torch.float32):
        s = self.spec
        mems = []
        for _ in range(s.n_layer):
            mems += [torch.zeros(s.k_shape(batch), dtype=dtype), torch.zeros(s.v_shape(batch), dtype=dtype)]
        return mems + [torch.full((batch,), initial_mem_count(self.cfg, self.mem_len), dtype=torch.int64)]

    def embed(self, tokens):
        if len(self.emb_bounds) == 1:
            emb = self.emb_tables[0](tokens)
            return (self.emb_projs[0](emb) if len(self.emb_projs) else emb) * self.emb_scale
        emb = 0
        for (lo, hi), table, proj in zip(self.emb_bounds, self.emb_tables, self.emb_projs):
            in_cluster = (tokens >= lo) & (tokens < hi)
            emb_i = proj(table((tokens - lo).clamp(0, hi - lo - 1)))
            emb = emb + torch.where(in_cluster[..., None], emb_i, torch.zeros_like(emb_i))
        return emb * self.emb_scale

    def log_probs(self, hidden):
        def logit(i):
            x = self.out_projs[i](hidden) if self.has_out_projs else hidden
            return self.out_logits[i](x)

        head = F.log_softmax(logit(0), dim=-1)
        if self.n_clusters == 0:
            return head
        out = [head[..., :self.layout.shortlist]]
        for i in range(1, self.n_clusters + 1):
            col = self.layout.head_column(i)  # head column -i: the original cluster order
            out.append(F.log_softmax(logit(i), dim=-1) + head[..., col:col + 1])
        return torch.cat(out, dim=-1)

    def forward(self, tokens, out_positions, *state):
        """As CachedTxl.forward, incremental layout: (log_probs [B, P, V], new_k.0, new_v.0, ...)."""
        cfg, M, T = self.cfg, self.mem_len, self.table_size
        mems, mem_count = state[:-1], state[-1]
        B, Q = tokens.shape
        H, Dh = cfg.n_head, cfg.d_head
        masks = attention_masks(tokens, mem_count, mems[0].shape[-1], M, T, H, self.window)

        h = self.embed(tokens)
        outs = []
        for i, layer in enumerate(self.layers):
            k_mem, v_mem = mems[2 * i], mems[2 * i + 1]
            x = layer.attn_norm(h) if cfg.pre_lnorm else h
            qkv = layer.qkv(x).view(B, Q, 3, H, Dh)
            vec, k, v = attend(qkv, k_mem, v_mem, getattr(self, f"r_w_bias_{i}"), getattr(self, f"r_r_bias_{i}"),
                               getattr(self, f"r_table_{i}"), masks, self.neg_inf)
            out = layer.o_net(vec.transpose(1, 2).reshape(B, Q, H * Dh))
            h = h + out if cfg.pre_lnorm else layer.attn_norm(h + out)
            out = layer.ff_out(F.relu(layer.ff_in(layer.ff_norm(h) if cfg.pre_lnorm else h)))
            if cfg.ff_out_relu:  # REMI's second feed-forward layer has a ReLU too
                out = F.relu(out)
            h = h + out if cfg.pre_lnorm else layer.ff_norm(h + out)
            outs += [k, v]

        h_out = torch.gather(h, 1, out_positions[:, :, None].expand(B, out_positions.shape[1], cfg.d_model))
        return (self.log_probs(h_out), *outs)

