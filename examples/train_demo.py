"""Train the bundled demo model: a small character-level Transformer-XL on the King James Bible.

Reproducible: seeded, single process, deterministic data order. Training follows the paper: the training text
is cut into `--batch-size` parallel streams, each stream is read in consecutive `tgt_len` segments, and every
layer's memory from one segment (detached, at most `mem_len` positions) is the extra context of the next.
Adam, linear warmup then cosine decay, gradient clipping at 0.25 as in the original run scripts.

    python examples/prepare_kjv.py --out data/kjv
    python examples/train_demo.py --data data/kjv --steps 6000 --batch-size 8 --threads 1 \
        --minutes 22 --out txl_deploy/assets/demo

writes `OUT/kjv-char/` (our checkpoint format) and `OUT/training.json` (command, seed, steps, losses, held-out
bits per character). `--minutes` stops early if the machine is slower than expected; training.json then
records it, and `--stop-after STEPS` (same `--steps`) replays that run exactly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from txl_deploy.checkpoints import save_checkpoint
from txl_deploy.config import TxlConfig
from txl_deploy.model.mem_transformer import MemTransformerLM
from txl_deploy.runtimes.evaluation import streaming_eval
from txl_deploy.vocab import Vocab

LN2 = math.log(2.0)


def init_weights(model: MemTransformerLM, std: float = 0.02, proj_std: float = 0.01):
    """The original `weights_init`: N(0, init_std) weights, zero biases, N(1, init_std) layer-norm gains."""
    for name, p in model.named_parameters():
        if name.endswith("layer_norm.weight"):
            torch.nn.init.normal_(p, 1.0, std)
        elif name.endswith(".bias") and "r_" not in name.rsplit(".", 1)[-1]:
            torch.nn.init.zeros_(p)
        elif "projs" in name:
            torch.nn.init.normal_(p, 0.0, proj_std)
        else:  # linear weights, embeddings, r_w_bias / r_r_bias
            torch.nn.init.normal_(p, 0.0, std)


def stream_batches(ids: np.ndarray, batch_size: int, tgt_len: int):
    """The original LMOrderedIterator: B parallel streams, consecutive segments, targets shifted by one."""
    n = (len(ids) - 1) // batch_size
    data = torch.from_numpy(ids[: n * batch_size + 1].copy())
    inputs = data[:-1].view(batch_size, n)
    targets = data[1:].view(batch_size, n)
    for start in range(0, n - tgt_len + 1, tgt_len):
        yield inputs[:, start : start + tgt_len], targets[:, start : start + tgt_len]


def torch_step(model: MemTransformerLM):
    """A stateful `step(tokens[B, Q]) -> log_probs[B, Q, V]` (numpy) that threads the memory, for `streaming_eval`."""
    state = {"mems": None}

    @torch.no_grad()
    def step(tokens):
        log_probs, state["mems"] = model(torch.from_numpy(np.asarray(tokens, dtype=np.int64)), state["mems"])
        return log_probs.numpy()

    return step


def lr_at(step: int, steps: int, warmup: int, lr: float, lr_min: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr_min + 0.5 * (lr - lr_min) * (1 + math.cos(math.pi * min(1.0, progress)))


# How the training log reports the loss: (name, from the mean nll in nats, digits kept in training.json, print format)
BPC = ("bpc", lambda loss: loss / LN2, 4, ".4f")
PPL = ("ppl", math.exp, 1, "7.1f")


def train(model, train_ids, args, metric, unit: str, stop_after: int | None = None):
    """The training loop both example trainers share: Adam over `args.batch_size` parallel streams of
    `args.tgt_len` segments, the memory carried from one segment to the next (dropped at a new pass over the
    text), the learning rate of `lr_at`, gradients clipped at `args.clip`; a log line and a history entry every 50
    steps, in `metric` (BPC or PPL) and `unit`s a second. Stops after `args.steps`, after `stop_after` steps, or
    once `args.minutes` of training have passed. Returns (steps, epoch, history, stopped early, seconds)."""
    name, convert, digits, fmt = metric
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    step, epoch, mems = 0, 0, None
    batches = stream_batches(train_ids, args.batch_size, args.tgt_len)
    log_loss, log_n, history, stopped_early = 0.0, 0, [], False
    model.train()
    while step < args.steps:
        try:
            inp, tgt = next(batches)
        except StopIteration:  # a new pass over the text: the memory of the last segment is not its context
            epoch += 1
            batches, mems = stream_batches(train_ids, args.batch_size, args.tgt_len), None
            continue
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.warmup, args.lr, args.lr_min)
        log_probs, mems = model(inp, mems)
        loss = F.nll_loss(log_probs.reshape(-1, log_probs.shape[-1]), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        log_loss, log_n = log_loss + loss.item(), log_n + 1
        elapsed = time.perf_counter() - t0
        if step % 50 == 0 or step in (10, args.steps):
            avg = log_loss / log_n
            history.append({"step": step, "loss": round(avg, 4), name: round(convert(avg), digits),
                            "seconds": round(elapsed)})
            print(f"step {step:5d} | epoch {epoch} | lr {opt.param_groups[0]['lr']:.2e} | loss {avg:.4f} | "
                  f"{name} {convert(avg):{fmt}} | {elapsed / 60:5.1f} min | "
                  f"{step * inp.numel() / elapsed:,.0f} {unit}/s", flush=True)
            log_loss, log_n = 0.0, 0
        if stop_after is not None and step >= stop_after:
            break
        if elapsed > args.minutes * 60:
            stopped_early = True
            print(f"time budget of {args.minutes} minutes reached at step {step}", flush=True)
            break
    return step, epoch, history, stopped_early, time.perf_counter() - t0


def sample(model, vocab, prompt: str, n: int, greedy: bool = True, generator=None) -> str:
    step = torch_step(model)
    log_probs = step(vocab.encode(prompt)[None])
    out = []
    for _ in range(n):
        last = torch.from_numpy(log_probs[0, -1])
        nxt = int(last.argmax()) if greedy else int(torch.multinomial(last.exp(), 1, generator=generator))
        out.append(nxt)
        log_probs = step(np.array([[nxt]]))
    return prompt + vocab.decode(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/kjv", help="folder with train.txt and heldout.txt (prepare_kjv.py)")
    p.add_argument("--out", default="txl_deploy/assets/demo", help="where kjv-char/ and training.json go")
    p.add_argument("--seed", type=int, default=1111, help="seed for initialisation and sampling")
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps (the cosine schedule spans them)")
    p.add_argument("--minutes", type=float, default=25.0, help="stop early after this much training wall time")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps of the --steps schedule (reproduces a run --minutes cut short)")
    p.add_argument("--batch-size", type=int, default=8, help="parallel streams per step")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--d-head", type=int, default=48)
    p.add_argument("--d-inner", type=int, default=768)
    p.add_argument("--tgt-len", type=int, default=64, help="segment length")
    p.add_argument("--mem-len", type=int, default=128, help="memory length (training and evaluation)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--lr-min", type=float, default=1e-4, help="learning rate at the end of the cosine")
    p.add_argument("--warmup", type=int, default=400, help="linear warmup steps")
    p.add_argument("--clip", type=float, default=0.25, help="gradient norm clip")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: two threads spin-wait badly on a busy machine)")
    p.add_argument("--eval-slice", type=int, default=4096, help="characters of held-out text the test checks")
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # denormal arithmetic is very slow on CPUs, and changes nothing here
    data = Path(args.data)
    train_text = (data / "train.txt").read_text(encoding="utf-8")
    held_text = (data / "heldout.txt").read_text(encoding="utf-8")
    vocab = Vocab(sorted(set(train_text)), kind="char")
    missing = set(held_text) - set(vocab.symbols)
    if missing:
        raise SystemExit(f"held-out text has characters the training text lacks: {sorted(missing)}")
    train_ids = vocab.encode(train_text)

    cfg = TxlConfig(
        n_token=len(vocab), n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, d_head=args.d_head,
        d_inner=args.d_inner, mem_len=args.mem_len, tgt_len=args.tgt_len,
    )
    model = MemTransformerLM(cfg)
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(vocab)} chars, {len(train_ids):,} training characters, {n_params:,} parameters", flush=True)
    step, epoch, history, stopped_early, train_seconds = train(model, train_ids, args, BPC, "chars",
                                                               stop_after=args.stop_after)

    model.eval()
    held_ids = vocab.encode(held_text)
    slice_ids = held_ids[: args.eval_slice]
    t1 = time.perf_counter()
    full = streaming_eval(held_ids, torch_step(model), cfg.tgt_len)
    part = streaming_eval(slice_ids, torch_step(model), cfg.tgt_len)
    print(f"held-out: {full['bits_per_token']:.4f} bpc over {full['n_tokens']:,} characters "
          f"({time.perf_counter() - t1:.0f} s); first {args.eval_slice} characters: {part['bits_per_token']:.4f} bpc",
          flush=True)

    greedy = sample(model, vocab, "And God said", 300)
    gen = torch.Generator().manual_seed(args.seed)
    sampled = sample(model, vocab, "And the LORD said unto Moses", 400, greedy=False, generator=gen)
    print("--- greedy ---\n" + greedy + "\n--- sampled ---\n" + sampled, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "kjv-char", model, vocab, force=args.force)
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "seed": args.seed,
        "steps": step,
        "steps_planned": args.steps,
        "stopped_early_by_time_budget": stopped_early,
        "epochs_started": epoch + 1,
        "characters_seen": step * args.batch_size * args.tgt_len,
        "train_wall_seconds": round(train_seconds, 1),
        "final_train_loss": history[-1]["loss"] if history else None,
        "final_train_bpc": history[-1]["bpc"] if history else None,
        "parameters": n_params,
        "config": cfg.to_dict(),
        "optimizer": {"name": "Adam", "lr": args.lr, "lr_min": args.lr_min, "warmup": args.warmup,
                      "schedule": "linear warmup, cosine decay", "clip": args.clip, "batch_size": args.batch_size},
        "heldout": {
            "file": "heldout.txt",
            "description": "every 40th chapter of the KJV (prepare_kjv.py --every 40)",
            "characters": int(full["n_tokens"]) + 1,
            "bpc": round(full["bits_per_token"], 4),
            "evaluation": f"streaming, batch 1, tgt_len {cfg.tgt_len}, mem_len {cfg.mem_len}, memory threaded",
        },
        "heldout_slice": {
            "characters": len(slice_ids),
            "description": f"the first {len(slice_ids)} characters of heldout.txt",
            "bpc": round(part["bits_per_token"], 6),
        },
        "samples": {"greedy 'And God said'": greedy, "sampled 'And the LORD said unto Moses'": sampled},
        "history": history,
        "torch_version": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out / 'kjv-char'} and {out / 'training.json'}", flush=True)


if __name__ == "__main__":
    main()
