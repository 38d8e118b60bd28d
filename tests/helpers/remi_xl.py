"""Compound Word Transformer's remi-xl checkpoints, built from names and shapes alone, and an independent reference of
what its model computes.

The file layout is a fact of its training code (workspace/uncond/remi-xl/model.py): `ep_N.pth.tar` is `torch.save`
of `{'epoch', 'model_setting', 'train_setting', 'state_dict', 'best_loss', 'optimizer'}`, `model_setting` the MODEL
section of the run's config.yml, `optimizer` Adam's `state_dict()`. The state_dict names are its module's
(`modules.py`): the original CMU names, `word_emb.lut.weight` and `linear_proj.{weight,bias}`, in the order
`model.state_dict()` lists them.

`reference_log_probs` is what that module computes, written from its semantics in float64, sequence-first as it
runs, with its own mask formula (`triu(1 + mlen) + tril(-shift)`) and the relative positions taken one key at a time
(no shift trick): an implementation independent of txl_deploy's.
"""

from __future__ import annotations

import math

import torch

# Small dims; the keys are the MODEL section's (the published run: 12 layers, d_model 512, 8 heads, mem_len 512).
SETTING = {
    "n_head": 2, "n_layer": 2, "dropout": 0.1, "d_inner": 24, "d_embed": 16, "d_model": 16, "dropatt": 0.0,
    "query_dim": 16, "seq_len": 16, "n_token": 30, "mem_len": 6, "ext_len": 0, "tgt_len": 4, "eval_tgt_len": 4,
    "init": "normal", "emb_init": "normal", "init_range": 0.1, "emb_init_range": 0.01, "init_std": 0.02,
    "proj_init_std": 0.01, "clamp_len": -1, "div_val": 1, "position_concat": False, "pre_lnorm": True,
    "same_length": True,
}
TRAIN_SETTING = {
    "ROOT": "../../../dataset/representations/uncond/remi/ailab17k_from-scratch_remi", "gpuID": "1",
    "output_dir": "./exp", "batch_size": 10, "lr": 0.0002, "num_epochs": 600, "save_freq": 10, "seed": 2222,
    "optim": "adam", "no_cuda": False, "resume_training_model": "None", "experiment_Dir": "./exp/20200901-064426",
}
# The published run's MODEL section (its config.yml), for the shapes of the published checkpoint.
PUBLISHED_SETTING = {**SETTING, "n_head": 8, "n_layer": 12, "d_inner": 2048, "d_embed": 512, "d_model": 512,
                     "seq_len": 512, "n_token": 332, "mem_len": 512, "tgt_len": 70, "eval_tgt_len": 50}
PUBLISHED_PARAMETERS = 41_291_084  # the parameters of the published ep_170.pth.tar


def state_dict(setting=SETTING, seed=0) -> dict:
    """Random tensors in remi-xl's names and shapes, in its `state_dict()` order."""
    gen = torch.Generator().manual_seed(seed)
    d, h, v, inner = setting["d_model"], setting["n_head"], setting["n_token"], setting["d_inner"]
    dh = d // h

    def rand(*shape, base=0.0, scale=0.15):
        return base + scale * torch.randn(shape, generator=gen)

    sd = {"r_w_bias": rand(h, dh), "r_r_bias": rand(h, dh), "word_emb.lut.weight": rand(v, d, scale=0.5)}
    for i in range(setting["n_layer"]):
        p = f"layers.{i}."
        sd[p + "dec_attn.qkv_net.weight"] = rand(3 * h * dh, d)
        sd[p + "dec_attn.o_net.weight"] = rand(d, h * dh)
        sd[p + "dec_attn.layer_norm.weight"] = rand(d, base=1.0, scale=0.1)
        sd[p + "dec_attn.layer_norm.bias"] = rand(d, scale=0.1)
        sd[p + "dec_attn.r_net.weight"] = rand(h * dh, d)
        sd[p + "pos_ff.CoreNet.0.weight"] = rand(inner, d)
        sd[p + "pos_ff.CoreNet.0.bias"] = rand(inner)
        sd[p + "pos_ff.CoreNet.3.weight"] = rand(d, inner)
        sd[p + "pos_ff.CoreNet.3.bias"] = rand(d)
        sd[p + "pos_ff.layer_norm.weight"] = rand(d, base=1.0, scale=0.1)
        sd[p + "pos_ff.layer_norm.bias"] = rand(d, scale=0.1)
    sd["linear_proj.weight"] = rand(v, d)
    sd["linear_proj.bias"] = rand(v, scale=0.5)
    sd["pos_emb.inv_freq"] = 1 / (10000 ** (torch.arange(0.0, d, 2.0) / d))
    return sd


def adam_state(sd: dict) -> dict:
    """Adam's `state_dict()` after one step over the trainable tensors, as its training saves it."""
    params = [torch.nn.Parameter(t.clone()) for k, t in sd.items() if k != "pos_emb.inv_freq"]
    optimizer = torch.optim.Adam(params, lr=TRAIN_SETTING["lr"])
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer.state_dict()


def save_pth_tar(path, sd: dict, setting=SETTING, with_model_setting=True, epoch=170):
    """`ep_N.pth.tar` as its training writes it (`with_model_setting=False`: a dict without `model_setting`)."""
    state = {"epoch": epoch, "model_setting": dict(setting), "train_setting": dict(TRAIN_SETTING),
             "state_dict": dict(sd), "best_loss": 0.1234, "optimizer": adam_state(sd)}
    if not with_model_setting:
        del state["model_setting"]
    torch.save(state, path)
    return path


def write_config_yml(folder, setting=SETTING):
    """The run folder's config.yml (its train.py writes it with yaml.dump): MODEL and TRAIN sections."""
    import yaml

    (folder / "config.yml").write_text(yaml.dump({"MODEL": dict(setting), "TRAIN": dict(TRAIN_SETTING)}))


def _layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def reference_log_probs(sd: dict, setting: dict, segments: list) -> list:
    """Log-probs [B, Q, V] of each segment ([B, Q] token ids) fed in turn from an empty memory, float64."""
    W = {k: t.double() for k, t in sd.items()}
    d, H, M, L = setting["d_model"], setting["n_head"], setting["mem_len"], setting["n_layer"]
    dh, pre = d // H, setting["pre_lnorm"]
    inv_freq = 1 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))
    mems = [torch.zeros(0, segments[0].shape[0], d, dtype=torch.float64) for _ in range(L + 1)]
    out = []
    for seg in segments:
        x = seg.t()  # [Q, B], as it runs
        qlen, mlen = x.shape[0], mems[0].shape[0]
        klen = mlen + qlen
        masked = torch.zeros(qlen, klen, dtype=torch.bool)
        shift = qlen - (klen - M) if klen - M > 0 else qlen
        for i in range(qlen):
            for j in range(klen):
                masked[i, j] = j > i + mlen or (setting["same_length"] and j <= i - shift)
        h = W["word_emb.lut.weight"][x] * math.sqrt(d)
        hids = [h]
        for layer in range(L):
            p = f"layers.{layer}."
            cat = torch.cat([mems[layer], h], 0)
            ln_in = _layer_norm(cat, W[p + "dec_attn.layer_norm.weight"], W[p + "dec_attn.layer_norm.bias"])
            heads = (ln_in if pre else cat) @ W[p + "dec_attn.qkv_net.weight"].t()
            q, k, v = heads[-qlen:, :, :H * dh], heads[:, :, H * dh:2 * H * dh], heads[:, :, 2 * H * dh:]
            vec = torch.zeros(qlen, h.shape[1], H * dh, dtype=torch.float64)
            for i in range(qlen):
                for n in range(H):
                    sl = slice(n * dh, (n + 1) * dh)
                    scores = torch.full((h.shape[1], klen), float("-inf"), dtype=torch.float64)
                    for j in range(klen):
                        if masked[i, j]:
                            continue
                        dist = torch.tensor([float(mlen + i - j)], dtype=torch.float64)
                        if setting["clamp_len"] > 0:
                            dist = dist.clamp(max=setting["clamp_len"])
                        angles = dist[:, None] * inv_freq[None]
                        r = (torch.cat([angles.sin(), angles.cos()], -1) @ W[p + "dec_attn.r_net.weight"].t())[0]
                        scores[:, j] = (((q[i, :, sl] + W["r_w_bias"][n]) * k[j, :, sl]).sum(-1)
                                        + ((q[i, :, sl] + W["r_r_bias"][n]) * r[sl]).sum(-1)) / math.sqrt(dh)
                    vec[i, :, sl] = torch.einsum("bj,jbd->bd", torch.softmax(scores, -1), v[:, :, sl])
            attn = vec @ W[p + "dec_attn.o_net.weight"].t()
            h = h + attn if pre else _layer_norm(h + attn, W[p + "dec_attn.layer_norm.weight"],
                                                  W[p + "dec_attn.layer_norm.bias"])
            ff_ln = (W[p + "pos_ff.layer_norm.weight"], W[p + "pos_ff.layer_norm.bias"])
            inner = torch.relu((_layer_norm(h, *ff_ln) if pre else h) @ W[p + "pos_ff.CoreNet.0.weight"].t()
                               + W[p + "pos_ff.CoreNet.0.bias"])
            core = inner @ W[p + "pos_ff.CoreNet.3.weight"].t() + W[p + "pos_ff.CoreNet.3.bias"]
            h = h + core if pre else _layer_norm(h + core, *ff_ln)
            hids.append(h)
        mems = [torch.cat([m, hid], 0)[max(0, mlen + qlen - M):mlen + qlen] for m, hid in zip(mems, hids)]
        logits = h @ W["linear_proj.weight"].t() + W["linear_proj.bias"]
        out.append(torch.log_softmax(logits, -1).transpose(0, 1))
    return out
