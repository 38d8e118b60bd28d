"""A tiny word model whose vocabulary is WikiText-103's kind of symbols: Moses-tokenized words, punctuation, and the
`@-@`, `@,@` and `@.@` that WikiText-103 puts inside hyphenated words and numbers. Random weights (`helpers.tiny`),
so seeded sampling writes every kind of symbol next to every other: what the detokenizer has to join."""

from __future__ import annotations

from helpers.tiny import TINY, make_tiny_model

# 60 symbols, as many as the tiny model's n_token; <eos> and <unk> where WikiText-103's vocab.txt has them (first)
WIKITEXT_SYMBOLS = [
    "<eos>", "<unk>", "the", ",", ".", "@-@", "@,@", "@.@", "of", "and",
    "in", "to", "a", "was", "\"", "(", ")", "'s", "1", "000",
    "2004", "3", "5", "game", "released", "it", "sold", "copies", "its", "first",
    "year", "well", "known", "film", "million", "New", "York", "City", ":", ";",
    "=", "is", "he", "she", "at", "on", "by", "for", "with", "as",
    "United", "States", "$", "%", "'", "!", "?", "-", "Zürich", "café",
]
assert len(WIKITEXT_SYMBOLS) == TINY["n_token"] and len(set(WIKITEXT_SYMBOLS)) == TINY["n_token"]

# A pre-tokenized line as WikiText-103's test file has them, and the natural text it stands for
TOKENIZED_LINE = "the game was released in 2004 , and it sold 1 @,@ 000 copies in its first year ."
NATURAL_LINE = "the game was released in 2004, and it sold 1,000 copies in its first year."


def save_wikitext_model(path, seed: int = 3):
    """The tiny model with WIKITEXT_SYMBOLS, saved as our checkpoint folder at `path`; returns `path`. Its
    tokenizer is the one the symbols show: wikitext."""
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    save_checkpoint(path, make_tiny_model(seed), Vocab(WIKITEXT_SYMBOLS))
    return path


def export_wikitext_onnx(root):
    """save_wikitext_model under `root`, exported to `root`/wt.onnx (what the runtime, the server and Triton run);
    returns the ONNX file's path."""
    from txl_deploy.exporters.onnx.export import export_onnx

    return export_onnx(save_wikitext_model(root / "wt"), root / "wt.onnx", max_segment=16, verify=False).path
