"""Options shared by several commands: --threads, how a checkpoint is read, and the sampling parameters."""

import functools
from pathlib import Path

import click

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.hub import HubReference, fetch_snapshot, is_hub_reference, parse_reference
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.pte_file import read_pte_info
from txl_deploy.errors import InputError
from txl_deploy.music.representation import REPRESENTATIONS
from txl_deploy.vocab import KINDS, TOKENIZERS

THREADS_HELP = ("CPU threads: ONNX Runtime's intra-op threads (one inter-op thread) and torch.set_num_threads for "
                "the PyTorch side. No effect on a TensorRT engine, which runs on the GPU (a warning says so). "
                "[default: each library's own, one thread per core]")


class ModelReference(click.ParamType):
    """A model argument that is a local path (checked as `path_type` checks it) or a hub reference
    (`hf://OWNER/NAME[@REVISION]`, checked here and fetched by `local_model` when the command runs, so that a
    mistake in another option costs no download)."""

    name = "path"

    def __init__(self, path_type: click.Path):
        self.path_type = path_type

    def convert(self, value, param, ctx):
        if isinstance(value, HubReference):
            return value
        if is_hub_reference(value):
            return parse_reference(value)  # a bad one: InputError, the one-line message of every other mistake
        return self.path_type.convert(value, param, ctx)


def local_model(model):
    """The local path of a model argument: a hub reference's snapshot folder (fetched, or found in the cache),
    anything else as given."""
    return fetch_snapshot(model) if isinstance(model, HubReference) else model


def model_vocab(path: Path, **how):
    """The vocabulary of a model (an .onnx's metadata, a .pte's sidecar, or a checkpoint read with `how`), or None;
    an exported file's weights are not read."""
    if path.suffix == ".onnx" and path.is_file():
        return read_onnx_info(path).vocab
    if path.suffix == ".pte" and path.is_file():
        return read_pte_info(path).vocab
    return load_model(path, **how).vocab


def threads_option(f):
    """`--threads N`, the same on every command that runs a model (passed to `TxlRuntime.load(threads=N)`)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)(f)


VOCAB_HELP = ("Vocabulary file: our vocab.json, the original one-symbol-a-line vocab.txt, a character list "
              "(with --vocab-kind char), HuggingFace's transfo-xl vocab.pkl or vocab.bin, a TensorFlow model's "
              "data/cache.pkl, the original PyTorch code's corpus cache.pt, or a music model's event dictionary "
              "(REMI's and remi-xl's dictionary.pkl; ProgGP's vocab_song_artist.pkl with rev_vocab_song_artist.pkl "
              "beside it). The pickles are read without running anything: only the symbols and the tokenizer's "
              "settings are taken. Overrides a vocabulary found in or beside the checkpoint.")


CONFIG_HELP = ("JSON config for a bare state_dict: our TxlConfig fields or the original MemTransformerLM "
               "constructor arguments. Default: <name>.json or config.json beside the weights. For a TensorFlow "
               "checkpoint: its training flags under tf/train_gpu.py's names (n_layer, mem_len, same_length, ...). "
               "For a remi-xl ep_N.pth.tar without model_setting: its run's config.yml (the MODEL section; "
               "default: config.yml beside it).")


PRESET_HELP = ("Which of the paper's published models a TensorFlow checkpoint is: its evaluation settings (tgt_len, "
               "mem_len, clamp_len, same_length) become the defaults. Default: the one its shapes fit.")


KIND_HELP = ("What the vocabulary's symbols are, and so how text is read and written: word (whitespace-separated "
             "words; a text --vocab holds one a line), char (one symbol per character; a text --vocab is a "
             "character list), bytes (the paper's enwik8: each symbol a byte's decimal value; text is UTF-8, and "
             "newlines are dropped as the original preprocessing dropped them, so the model never sees or predicts "
             "one), text8 (the letters a-z and '_' for the space) or events (music events such as REMI's "
             "'Note On_60', kept whole, spaces included: text is one event a line; a text --vocab holds one event "
             "a line). [default: the vocabulary file's (events for an event dictionary, or for a text --vocab whose "
             "lines are all REMI's or remi-xl's events); else the corpus's (a "
             "TensorFlow corpus-info.json or a corpus cache saying enwik8 or text8); else bytes or text8 when the "
             "symbols are exactly those; else word]")


REPRESENTATION_HELP = ("The music representation an events vocabulary's events are written in: "
                       + "; ".join(f"{name} ({r.description})" for name, r in REPRESENTATIONS.items())
                       + ". Stored with the vocabulary; implies --vocab-kind events. [default: the vocabulary's "
                       "own, else the one its events show]")


def vocab_options(f):
    """--config, --preset, --vocab, --vocab-kind and --representation: how a checkpoint is read (convert, export,
    info)."""
    f = click.option("--representation", type=click.Choice(list(REPRESENTATIONS)), default=None,
                     help=REPRESENTATION_HELP)(f)
    f = click.option("--vocab-kind", type=click.Choice(list(KINDS)), default=None, help=KIND_HELP)(f)
    f = click.option("--vocab", "vocab", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help=VOCAB_HELP)(f)
    f = click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help=CONFIG_HELP)(f)
    f = click.option("--preset", type=click.Choice(["enwik8-large", "text8-large", "wt103-large", "lm1b-large"]),
                     default=None, help=PRESET_HELP)(f)
    return f


TOKENIZERS_HELP = ("How a word model's text is split into its words and joined again: whitespace (pre-tokenized "
                   "text: the words between spaces, printed as they are), wikitext (WikiText-103's: HuggingFace "
                   "TransfoXLTokenizer's Moses pipeline, numbers split as 1 @,@ 000 and 3 @.@ 5, dashes as @-@, "
                   "and joined again on output) or lm1b (the One Billion Word benchmark's Moses tokenization, <S> "
                   "around each line). [default: the vocabulary's own: stored with it, else what its symbols show]")


def tokenizer_option(how: str):
    """`--tokenizer NAME` (None: the vocabulary's own); `how` says what it changes (stored, or this run only)."""
    return click.option("--tokenizer", type=click.Choice(list(TOKENIZERS)), default=None,
                        help=f"{TOKENIZERS_HELP} {how}")


def with_tokenizer(vocab, tokenizer: str | None):
    """`vocab` read with `tokenizer` (None, or no vocabulary: as it is); a vocabulary of characters or bytes has
    no word tokenizer, a one-line error."""
    if tokenizer is None or vocab is None:
        return vocab
    try:
        return vocab.with_tokenizer(tokenizer)
    except ValueError as e:
        raise InputError(f"--tokenizer {tokenizer}: {e}") from None


def use_tokenizer(rt, tokenizer: str | None):
    """Make runtime `rt` read and write text with `tokenizer` for this run (the model's file is unchanged)."""
    if tokenizer is not None:
        try:
            rt.set_tokenizer(tokenizer)
        except InputError as e:
            raise InputError(f"--{e}") from None
    return rt


def _logit_bias(ctx, param, values):
    bias = {}
    for item in values:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise click.BadParameter(f"{item!r}: expected TOKEN_ID=BIAS, e.g. 17=-100") from None
        if not sep:
            raise click.BadParameter(f"{item!r}: expected TOKEN_ID=BIAS, e.g. 17=-100")
    return bias


def sampling_options(temperature: float):
    """The token-level sampling parameters (runtimes/sampling's SamplingParams, which checks them), with
    --max-new-tokens and --temperature defaulting as the command always did. The command gets `sampling`: a dict of
    SamplingParams keyword arguments (max_new_tokens is passed on as its own argument)."""
    options = [
        click.option("--temperature", type=float, default=temperature, show_default=True, help="0 is greedy."),
        click.option("--top-k", type=int, default=None, help="Sample only among the k most likely tokens."),
        click.option("--top-p", type=float, default=1.0, show_default=True,
                     help="Sample only within this probability mass (nucleus), in (0, 1]."),
        click.option("--min-p", type=float, default=0.0, show_default=True,
                     help="Drop tokens less likely than this fraction of the most likely one, in [0, 1]."),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
                     help="HuggingFace's penalty on tokens of the prompt and the generated text (> 1 discourages)."),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                     help="OpenAI's penalty on tokens generated at least once, in [-2, 2]."),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                     help="OpenAI's penalty per time a token was generated, in [-2, 2]."),
        click.option("--no-repeat-ngram-size", type=int, default=0, show_default=True,
                     help="Never repeat an n-gram of the prompt and the generated text (0: off)."),
        click.option("--logit-bias", multiple=True, callback=_logit_bias, metavar="ID=BIAS",
                     help="Add BIAS (in [-100, 100]) to token ID's score; repeatable."),
        click.option("--min-tokens", type=int, default=0, show_default=True,
                     help="Generate at least this many tokens before a --stop-token-id may end the text."),
        click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
                     help="A token id that ends generation; repeatable."),
        click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible output)."),
        click.option("--no-unk", "ban_unk", is_flag=True, default=False,
                     help="Never sample <unk> (the word WikiText-103 and lm1b put in place of every rare word), so "
                          "it never appears in the text."),
    ]

    def decorate(f):
        names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "no_repeat_ngram_size", "logit_bias", "min_tokens", "stop_token_ids", "seed",
                 "ban_unk")

        def wrapper(*args, **kwargs):
            kwargs["sampling"] = {name: kwargs.pop(name) for name in names}
            return f(*args, **kwargs)

        wrapper = functools.update_wrapper(wrapper, f)
        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate
