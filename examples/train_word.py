"""Train a small word-level Transformer-XL with an adaptive softmax on the King James Bible.

The model the lazy-decoding tests and benchmark read their tail statistics from: a word model's next-word
distribution is peaked the way a trained model's is (random weights give flat ones), so how often a sampler needs
a tail cluster is what a deployed model sees. Words are split on whitespace (the `word` kind's `whitespace`
tokenizer, `<eos>` at each line end); the vocabulary is every word seen at least `--min-count` times in the
training text, most frequent first (the adaptive softmax's clusters are frequency bands), then `<unk>`.

Training is `train_demo.py`'s: parallel streams read in consecutive segments, memory carried between segments,
Adam with linear warmup and cosine decay, gradient clipping.

    python examples/prepare_kjv.py --out data/kjv
    python examples/train_word.py --data data/kjv --minutes 11 --out tests/data/kjv-words

writes `OUT/model/` (our checkpoint format) and `OUT/training.json` (command, seed, steps, losses, held-out
perplexity).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections import Counter
from pathlib import Path

import torch
from train_demo import PPL, init_weights, torch_step, train  # the char demo's trainer, same folder

from txl_deploy.checkpoints import save_checkpoint
from txl_deploy.config import TxlConfig
from txl_deploy.model.mem_transformer import MemTransformerLM
from txl_deploy.runtimes.evaluation import streaming_eval
from txl_deploy.vocab import Vocab

EOS, UNK = "<eos>", "<unk>"


def word_vocab(train_text: str, min_count: int) -> Vocab:
    """`<eos>` (one per line, the most frequent symbol), the words seen `min_count` times or more by falling
    count (ties in first-seen order, so the order is deterministic), then `<unk>`."""
    counts = Counter(train_text.split())
    words = [w for w, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n >= min_count]
    return Vocab([EOS, *words, UNK], kind="word", tokenizer="whitespace")


def greedy_words(model, vocab, prompt: str, n: int) -> str:
    step = torch_step(model)
    log_probs = step(vocab.encode(prompt, add_eos=False)[None])
    out = []
    for _ in range(n):
        nxt = int(log_probs[0, -1].argmax())
        out.append(nxt)
        log_probs = step([[nxt]])
    return prompt + " " + vocab.decode(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/kjv", help="folder with train.txt and heldout.txt (prepare_kjv.py)")
    p.add_argument("--out", default="tests/data/kjv-words", help="where model/ and training.json go")
    p.add_argument("--seed", type=int, default=1111)
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps (the cosine schedule spans them)")
    p.add_argument("--minutes", type=float, default=11.0, help="stop early after this much training wall time")
    p.add_argument("--min-count", type=int, default=2, help="words seen fewer times are <unk>")
    p.add_argument("--cutoffs", type=int, nargs="+", default=[500, 2000, 6000], help="adaptive softmax cutoffs")
    p.add_argument("--div-val", type=int, default=2, help="each cluster's embedding is div_val times narrower")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-head", type=int, default=32)
    p.add_argument("--d-inner", type=int, default=512)
    p.add_argument("--tgt-len", type=int, default=32)
    p.add_argument("--mem-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-min", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # denormal arithmetic is very slow on CPUs, and changes nothing here
    data = Path(args.data)
    train_text = (data / "train.txt").read_text(encoding="utf-8")
    held_text = (data / "heldout.txt").read_text(encoding="utf-8")
    vocab = word_vocab(train_text, args.min_count)
    if len(vocab) <= args.cutoffs[-1]:
        raise SystemExit(f"the last cutoff {args.cutoffs[-1]} is not below the vocabulary size {len(vocab)}")
    train_ids = vocab.encode(train_text)

    cfg = TxlConfig(
        n_token=len(vocab), n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, d_head=args.d_head,
        d_inner=args.d_inner, mem_len=args.mem_len, tgt_len=args.tgt_len, cutoffs=args.cutoffs,
        div_val=args.div_val, tie_weight=True, tie_projs=[False] + [True] * len(args.cutoffs),
    )
    model = MemTransformerLM(cfg)
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(vocab)} words, {len(train_ids):,} training tokens, {n_params:,} parameters", flush=True)
    step, epoch, history, stopped_early, train_seconds = train(model, train_ids, args, PPL, "tok")

    model.eval()
    held_ids = vocab.encode(held_text)
    full = streaming_eval(held_ids, torch_step(model), cfg.tgt_len)
    held_ppl = 2.0 ** full["bits_per_token"]
    print(f"held-out: perplexity {held_ppl:.1f} over {full['n_tokens']:,} words", flush=True)
    greedy = greedy_words(model, vocab, "And God said", 40)
    print("--- greedy ---\n" + greedy, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "model", model, vocab, force=args.force)
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "seed": args.seed,
        "steps": step,
        "steps_planned": args.steps,
        "stopped_early_by_time_budget": stopped_early,
        "epochs_started": epoch + 1,
        "tokens_seen": step * args.batch_size * args.tgt_len,
        "train_wall_seconds": round(train_seconds, 1),
        "final_train_loss": history[-1]["loss"] if history else None,
        "final_train_ppl": history[-1]["ppl"] if history else None,
        "parameters": n_params,
        "vocabulary": {"words": len(vocab), "min_count": args.min_count, "tokenizer": "whitespace",
                       "order": "<eos>, words by falling training count, <unk>"},
        "config": cfg.to_dict(),
        "optimizer": {"name": "Adam", "lr": args.lr, "lr_min": args.lr_min, "warmup": args.warmup,
                      "schedule": "linear warmup, cosine decay", "clip": args.clip, "batch_size": args.batch_size},
        "heldout": {
            "file": "txl_deploy/assets/demo/heldout.txt",
            "words": int(full["n_tokens"]) + 1,
            "perplexity": round(held_ppl, 2),
            "evaluation": f"streaming, batch 1, tgt_len {cfg.tgt_len}, mem_len {cfg.mem_len}, memory threaded",
        },
        "samples": {"greedy 'And God said'": greedy},
        "history": history,
        "torch_version": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out / 'model'} and {out / 'training.json'}", flush=True)


if __name__ == "__main__":
    main()
