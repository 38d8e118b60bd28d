"""Options shared by several commands: --threads, and how a checkpoint is read."""

from pathlib import Path

import click

from txl_deploy.vocab import KINDS

THREADS_HELP = ("CPU threads: ONNX Runtime's intra-op threads (one inter-op thread) and torch.set_num_threads for "
                "the PyTorch side. No effect on a TensorRT engine, which runs on the GPU (a warning says so). "
                "[default: each library's own, one thread per core]")


def threads_option(f):
    """`--threads N`, the same on every command that runs a model (passed to `TxlRuntime.load(threads=N)`)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)(f)


VOCAB_HELP = ("Vocabulary file: our vocab.json, the original one-symbol-a-line vocab.txt, a character list "
              "(with --vocab-kind char), a TensorFlow model's data/cache.pkl or the original PyTorch code's corpus "
              "cache.pt (both read without running anything). Overrides a vocabulary found in or beside the "
              "checkpoint.")


CONFIG_HELP = ("JSON config for a bare state_dict: our TxlConfig fields or the original MemTransformerLM "
               "constructor arguments. Default: <name>.json or config.json beside the weights. For a TensorFlow "
               "checkpoint: its training flags under tf/train_gpu.py's names (n_layer, mem_len, same_length, ...).")


PRESET_HELP = ("Which of the paper's published models a TensorFlow checkpoint is: its evaluation settings (tgt_len, "
               "mem_len, clamp_len, same_length) become the defaults. Default: the one its shapes fit.")


KIND_HELP = ("What the vocabulary's symbols are, and so how text is read and written: word (whitespace-separated "
             "words; a text --vocab holds one a line), char (one symbol per character; a text --vocab is a "
             "character list), bytes (the paper's enwik8: each symbol a byte's decimal value; text is UTF-8, and "
             "newlines are dropped as the original preprocessing dropped them, so the model never sees or predicts "
             "one) or text8 (the letters a-z and '_' for the space). [default: the vocabulary file's; else the "
             "corpus's (a TensorFlow corpus-info.json or a corpus cache saying enwik8 or text8); else bytes or "
             "text8 when the symbols are exactly those; else word]")


def vocab_options(f):
    """--config, --preset, --vocab and --vocab-kind: how a checkpoint is read (convert, export, info)."""
    f = click.option("--vocab-kind", type=click.Choice(list(KINDS)), default=None, help=KIND_HELP)(f)
    f = click.option("--vocab", "vocab", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help=VOCAB_HELP)(f)
    f = click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help=CONFIG_HELP)(f)
    f = click.option("--preset", type=click.Choice(["enwik8-large", "text8-large", "wt103-large", "lm1b-large"]),
                     default=None, help=PRESET_HELP)(f)
    return f
