"""The tiny word-level Transformer-XL most tests run (adaptive softmax, div_val 2, same_length, clamp_len).

`tests/conftest.py` saves it once per session as a checkpoint (`tiny_ckpt`) and exports it (`tiny_onnx`,
`tiny_onnx_full`); tests that need other weights or shapes build their own with `make_tiny_model(seed, **overrides)`.
"""

from __future__ import annotations

TINY = dict(n_token=60, n_layer=2, n_head=2, d_model=32, d_head=8, d_inner=64, mem_len=12, tgt_len=8,
            cutoffs=[10, 30], div_val=2, tie_projs=[False, True, True], same_length=True, clamp_len=9)
TINY_VOCAB = [f"w{i}" for i in range(58)] + ["<eos>", "<unk>"]


def make_tiny_model(seed=0, **overrides):
    import torch  # not every test folder runs with torch (the runtime path is torch-free)

    from txl_deploy.config import TxlConfig
    from txl_deploy.model.mem_transformer import MemTransformerLM

    torch.manual_seed(seed)
    model = MemTransformerLM(TxlConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model
