"""REMI (the Pop Music Transformer, YatingMusic/remi) for the tests: its variables under their exact TF1 names, and an
independent numpy reference of what its modules.py computes.

The reference follows modules.py's equations in its own arrangement: the relative term indexed by distance instead
of rel_shift, batch-first. What REMI computes differently from the paper is a switch of the reference, so a test can
show that leaving out any one of them changes the numbers: the ReLU after the feed-forward block's second Dense
layer, Keras's layer-norm epsilon 1e-3, and the memory that starts as mem_len zero vectors that are attended to.
"""

from __future__ import annotations

import numpy as np

SCOPE = "transformer/"


def keras_norm(i: int, part: str) -> str:
    """Keras numbers LayerNormalization layers across the graph: layer i's attention norm is the (2i)-th (the first
    has no suffix), its feed-forward norm the (2i+1)-th."""
    n = 2 * i + (part == "ff")
    return "layer_normalization" + (f"_{n}" if n else "")


def remi_variables(n_token=21, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=24, seed=0) -> dict:
    """{REMI variable name: float32 array} of a random model, as its Saver writes them (kernels [in, out])."""
    rng = np.random.default_rng(seed)

    def rnd(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hd = n_head * d_head
    w = {SCOPE + "r_w_bias": rnd(n_head, d_head), SCOPE + "r_r_bias": rnd(n_head, d_head),
         SCOPE + "normal_embed/lookup_table": rnd(n_token, d_model),
         SCOPE + "normal_softmax/bias": rnd(n_token, scale=0.1)}
    for i in range(n_layer):
        p = f"{SCOPE}layer_{i}/"
        w[p + "rel_attn/qkv/kernel"] = rnd(d_model, 3 * hd)
        w[p + "rel_attn/r/kernel"] = rnd(d_model, hd)
        w[p + "rel_attn/o/kernel"] = rnd(hd, d_model)
        w[p + f"rel_attn/{keras_norm(i, 'attn')}/gamma"] = 1 + rnd(d_model, scale=0.1)
        w[p + f"rel_attn/{keras_norm(i, 'attn')}/beta"] = rnd(d_model, scale=0.1)
        w[p + "ff/layer_1/kernel"] = rnd(d_model, d_inner)
        w[p + "ff/layer_1/bias"] = rnd(d_inner, scale=0.1)
        w[p + "ff/layer_2/kernel"] = rnd(d_inner, d_model)
        # a positive bias: REMI's second ReLU then passes some outputs and clips others
        w[p + "ff/layer_2/bias"] = rnd(d_model, scale=0.1)
        w[p + f"ff/{keras_norm(i, 'ff')}/gamma"] = 1 + rnd(d_model, scale=0.1)
        w[p + f"ff/{keras_norm(i, 'ff')}/beta"] = rnd(d_model, scale=0.1)
    return w


def _layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def remi_segment(w, tokens, mems, n_head, d_head, eps=1e-3, ff_out_relu=True):
    """One segment: tokens [B, Q], mems n_layer x [B, mlen, d_model] (float64) -> (log_probs [B, Q, V], the
    per-layer inputs of this segment, to be cached)."""
    table = w[SCOPE + "normal_embed/lookup_table"].astype(np.float64)
    d_model = table.shape[1]
    B, Q = tokens.shape
    mlen = mems[0].shape[1]
    klen = mlen + Q
    dist = np.arange(klen - 1, -1, -1.0)  # the relative position of key j as seen from the last query
    inv_freq = 1 / (10000 ** (np.arange(0, d_model, 2.0) / d_model))
    pos_emb = np.concatenate([np.sin(dist[:, None] * inv_freq), np.cos(dist[:, None] * inv_freq)], -1)
    h = table[tokens] * d_model**0.5
    rw, rr = (w[SCOPE + n].astype(np.float64) for n in ("r_w_bias", "r_r_bias"))
    i_idx, j_idx = np.arange(Q)[:, None], np.arange(klen)[None, :]
    distance = mlen + i_idx - j_idx  # [Q, K]: query i (stream position mlen + i) to key j
    future = distance < 0
    inputs = []
    n_layer = sum(1 for n in w if n.endswith("rel_attn/qkv/kernel"))
    for i in range(n_layer):
        p = f"{SCOPE}layer_{i}/"
        g = lambda n: w[p + n].astype(np.float64)  # noqa: E731
        inputs.append(h)
        cat = np.concatenate([mems[i], h], 1)  # [B, K, D]
        heads = cat @ g("rel_attn/qkv/kernel")
        q, k, v = np.split(heads, 3, -1)
        q = q[:, -Q:].reshape(B, Q, n_head, d_head)
        k, v = k.reshape(B, klen, n_head, d_head), v.reshape(B, klen, n_head, d_head)
        r_k = (pos_emb @ g("rel_attn/r/kernel")).reshape(klen, n_head, d_head)  # row r: distance klen - 1 - r
        ac = np.einsum("bihd,bjhd->bijh", q + rw, k)
        r_of = r_k[np.clip(klen - 1 - distance, 0, klen - 1)]  # [Q, K, H, Dh]: the sinusoid of each pair's distance
        bd = np.einsum("bihd,ijhd->bijh", q + rr, r_of)
        score = (ac + bd) / d_head**0.5
        score = np.where(future[None, :, :, None], -1e30, score)
        prob = np.exp(score - score.max(2, keepdims=True))
        prob /= prob.sum(2, keepdims=True)
        vec = np.einsum("bijh,bjhd->bihd", prob, v).reshape(B, Q, n_head * d_head)
        norm_a = [n for n in w if n.startswith(p + "rel_attn/layer_normalization")]
        ga = next(w[n] for n in norm_a if n.endswith("gamma")).astype(np.float64)
        ba = next(w[n] for n in norm_a if n.endswith("beta")).astype(np.float64)
        h = _layer_norm(h + vec @ g("rel_attn/o/kernel"), ga, ba, eps)
        inner = np.maximum(h @ g("ff/layer_1/kernel") + g("ff/layer_1/bias"), 0)
        out = inner @ g("ff/layer_2/kernel") + g("ff/layer_2/bias")
        if ff_out_relu:
            out = np.maximum(out, 0)
        norm_f = [n for n in w if n.startswith(p + "ff/layer_normalization")]
        gf = next(w[n] for n in norm_f if n.endswith("gamma")).astype(np.float64)
        bf = next(w[n] for n in norm_f if n.endswith("beta")).astype(np.float64)
        h = _layer_norm(h + out, gf, bf, eps)
    logits = h @ table.T + w[SCOPE + "normal_softmax/bias"].astype(np.float64)
    return _log_softmax(logits), inputs


def remi_stream(w, tokens, seg_len, mem_len, n_head, d_head, eps=1e-3, ff_out_relu=True, zero_memory=True):
    """Log-probs [B, T, V] of a stream fed seg_len tokens at a time, the memory threaded as modules.py's _cache_mem
    does (concat, keep the last mem_len). zero_memory: start from mem_len zero vectors (REMI's generate), else
    empty (the paper's PyTorch code)."""
    B = tokens.shape[0]
    d_model = w[SCOPE + "normal_embed/lookup_table"].shape[1]
    n_layer = sum(1 for n in w if n.endswith("rel_attn/qkv/kernel"))
    mems = [np.zeros((B, mem_len if zero_memory else 0, d_model)) for _ in range(n_layer)]
    out = []
    for start in range(0, tokens.shape[1], seg_len):
        lp, inputs = remi_segment(w, tokens[:, start:start + seg_len], mems, n_head, d_head, eps, ff_out_relu)
        mems = [np.concatenate([m, x], 1)[:, -mem_len:] for m, x in zip(mems, inputs)]
        out.append(lp)
    return np.concatenate(out, 1)
