"""`txl-deploy generate`: stream text from an exported graph, an engine or a checkpoint, or write a music model's
song as a MIDI file."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from txl_deploy.cli.options import (
    ModelReference,
    local_model,
    sampling_options,
    threads_option,
    tokenizer_option,
    use_tokenizer,
)
from txl_deploy.errors import InputError
from txl_deploy.files import atomic_path, check_writable
from txl_deploy.music.events_to_midi import events_to_score, write_midi
from txl_deploy.music.generation import UPSTREAM_TOKEN_LIMIT, generate_music, music_representation
from txl_deploy.music.grammar import GRAMMARS
from txl_deploy.music.midi_to_events import midi_to_events
from txl_deploy.music.piano_roll import write_piano_roll
from txl_deploy.music.representation import REPRESENTATIONS
from txl_deploy.runtimes import TxlRuntime

TEXT_MAX_NEW_TOKENS = 200
OUTPUT = click.Path(dir_okay=False, path_type=Path)


@click.command("generate")
@click.argument("model", type=ModelReference(click.Path(exists=True)))
@click.option("--prompt", help="Text to start from (needed for text). For a byte-level (enwik8) model it is read as "
              "UTF-8 with newlines dropped, as the model was trained; for text8, lowercase a-z and spaces.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=None,
              help=f"At most this many new tokens. [default: {TEXT_MAX_NEW_TOKENS}; a song: "
                   f"{UPSTREAM_TOKEN_LIMIT}, remi-xl's limit]")
@sampling_options(temperature=1.0)
@click.option("--num-beams", type=click.IntRange(min=2), default=None,
              help="Beam search with this many beams instead of sampling: print the best continuations, best "
                   "first, each after its score (HuggingFace's num_beams; --stop-token-id ends a beam).")
@click.option("--length-penalty", type=float, default=1.0, show_default=True,
              help="Beam search: a continuation scores its log-prob sum / its length ** this (> 0 favours long ones).")
@click.option("--early-stopping", type=click.Choice(["true", "false", "never"]), default="false", show_default=True,
              help="Beam search: true stops once num-beams continuations have ended; false stops when the best "
                   "running beam cannot beat them any more (judged at its current length); never judges it at the "
                   "longest length it could reach.")
@click.option("--num-return-sequences", type=click.IntRange(min=1), default=1, show_default=True,
              help="Beam search: print this many of the best continuations (at most --num-beams).")
@click.option("--grammar", type=click.Choice(sorted(GRAMMARS)), default=None,
              help="A music model: sample only the events this representation's grammar allows next, so its MIDI "
                   "writer places every one (valid music by construction). A song uses its own unless --no-grammar.")
@click.option("--midi", "midi_out", type=OUTPUT,
              help="A music model: generate a song and write it to this MIDI file (needs the music extra).")
@click.option("--events", "events_out", type=OUTPUT,
              help="A song: also write its events here, one a line (what `txl-deploy midi` reads).")
@click.option("--piano-roll", "roll_out", type=OUTPUT,
              help="A song: also draw its notes as a piano roll, a PNG picture (pitch up, time right, bars marked).")
@click.option("--bars", type=click.IntRange(min=1), default=None,
              help="A song: stop once this many bars are generated (Bar events counted, as REMI does). "
                   "[default: remi-xl at EOS_None; REMI 16]")
@click.option("--prompt-midi", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A song: continue this MIDI file (its REMI events, then a new bar) instead of the upstream "
                   "start (REMI: a bar, a random tempo class and value; remi-xl: a bar).")
@click.option("--chords/--no-chords", default=None,
              help="A song: start with a random chord, and read --prompt-midi's chords, as REMI's chord model "
                   "does. [default: on when MODEL's name says chord]")
@click.option("--representation", "representation_name", type=click.Choice(list(REPRESENTATIONS)), default=None,
              help="A song: the events' representation. [default: the one MODEL's vocabulary is]")
@click.option("--no-grammar", is_flag=True, help="A song: sample freely (the writer drops what it cannot place).")
@click.option("--force", is_flag=True, help="Overwrite the song's output files if they exist.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "executorch", "torch", "torch-fast"]),
              help="[default: by file type: .onnx -> onnxruntime, .engine -> tensorrt, .pte -> executorch, "
                   "checkpoint -> torch]")
@click.option("--providers", help="ONNX Runtime providers, comma-separated (cpu, cuda, tensorrt).")
@tokenizer_option("For this run only.")
@threads_option
def generate_cmd(model, prompt, max_new_tokens, sampling, num_beams, length_penalty, early_stopping,
                 num_return_sequences, grammar, midi_out, events_out, roll_out, bars, prompt_midi,
                 chords, representation_name, no_grammar, force, backend, providers, tokenizer, threads):
    """Stream text generated from MODEL (an .onnx, an .engine, an ExecuTorch .pte or a checkpoint) after PROMPT,
    or, with --midi (--events, --piano-roll), write a music model's song.

    The text is printed as it is generated, decoded incrementally: a character that a byte-level model spells over
    several tokens appears once complete, and bytes that are not UTF-8 print as U+FFFD. --no-unk keeps `<unk>` out
    of the text. The sampling options are those of the HTTP server (`txl-deploy serve`) and of
    `TxlRuntime.generate`.

    MODEL may be a HuggingFace hub reference, hf://OWNER/NAME[@REVISION], run as a checkpoint by PyTorch after it
    is fetched into the hub cache (or found there offline); exporting it first runs faster.

    --num-beams K searches instead of sampling (as HuggingFace's generate(num_beams=K, do_sample=False)) and
    prints --num-return-sequences continuations, best first, one a line: the score, a tab, the prompt and the
    continuation (a newline in them written \\n).

    A song (a REMI or remi-xl model, told by its vocabulary's events) starts as its project starts one, or from
    --prompt-midi, and stops after --bars bars or at remi-xl's EOS_None, sampled under the representation's grammar
    so the MIDI writer places every event. The same --seed gives the same song.

    \b
    Example:
      txl-deploy generate model.onnx --prompt "The river" --num-beams 4 --num-return-sequences 2 --stop-token-id 0
      txl-deploy generate REMI-tempo-checkpoint --midi song.mid --bars 16 --temperature 1.2 --top-k 5
      txl-deploy generate remi.onnx --midi more.mid --prompt-midi song.mid --events more.txt --piano-roll more.png
    """
    model = local_model(model)
    song = midi_out or events_out or roll_out
    if not song and (bars or prompt_midi or chords is not None or representation_name or no_grammar):
        raise click.UsageError("--bars, --prompt-midi, --chords, --representation and --no-grammar make a song: "
                               "pass --midi (or --events, --piano-roll)")
    if song and prompt is not None:
        raise click.UsageError("a song starts from --prompt-midi (or as its project starts one), not --prompt")
    if not song and prompt is None:
        raise click.UsageError("pass --prompt (text to continue), or --midi to write a music model's song")
    if num_beams is None and (num_return_sequences != 1 or _given("length_penalty", "early_stopping")):
        raise click.UsageError("--length-penalty, --early-stopping and --num-return-sequences need --num-beams")
    if num_beams is not None:
        sampled = [n for n in ("grammar", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                               "presence_penalty", "frequency_penalty", "no_repeat_ngram_size", "logit_bias",
                               "min_tokens", "seed", "ban_unk") if _given(n)]
        if song or sampled:
            raise click.UsageError("--num-beams searches text deterministically: drop "
                                   + ", ".join("--" + n.replace("_", "-") for n in sampled or ["midi"]))
    for out in (midi_out, events_out, roll_out):
        if out is not None:
            check_writable(out, force)  # before the song is generated, not after
    with TxlRuntime.load(model, backend=backend, providers=providers.split(",") if providers else None,
                         threads=threads) as rt:
        use_tokenizer(rt, tokenizer)
        if song:
            _song(rt, Path(model), max_new_tokens, sampling, grammar, midi_out, events_out, roll_out, bars,
                  prompt_midi, chords, representation_name, no_grammar, force)
            return
        if rt.vocab is None:
            raise InputError(f"{model}: has no vocabulary, so it cannot read a text prompt")
        # checked here, before the prompt is echoed
        max_new_tokens = TEXT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        if num_beams is not None:
            beams = rt.beam_search(prompt, num_beams, max_new_tokens, length_penalty=length_penalty,
                                   early_stopping={"true": True, "false": False}.get(early_stopping, early_stopping),
                                   num_return_sequences=num_return_sequences, stop=sampling["stop_token_ids"])
            for beam in beams:
                text = "".join(rt.vocab.stream_decoder(prompt, context=rt.encode(prompt)).pieces(beam.tokens))
                click.echo(f"{beam.score:.4f}\t" + (prompt + text).replace("\n", "\\n"))  # one line each
            return
        pieces = rt.generate_text(prompt, max_new_tokens, grammar=grammar, **sampling)
        click.echo(prompt, nl=False)
        for piece in pieces:  # decoded incrementally: a character over several byte tokens prints once whole
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()


def _given(*names) -> bool:
    """Whether any of these options was given on the command line (not left at its default)."""
    ctx = click.get_current_context()
    return any(ctx.get_parameter_source(n) not in (None, click.core.ParameterSource.DEFAULT) for n in names)


def _song(rt, model: Path, max_new_tokens, sampling, grammar, midi_out, events_out, roll_out, bars, prompt_midi,
          chords, representation_name, no_grammar, force):
    try:
        rep = music_representation(rt.vocab, representation_name)
    except InputError as e:
        raise InputError(f"{model}: {e}") from None
    if grammar is not None and grammar != rep.name:
        raise InputError(f"--grammar {grammar} does not match the model's {rep.name} events")
    if midi_out is not None:
        import mido  # noqa: F401  the music extra: when it is missing, its install hint comes before the song
    if chords is None:
        chords = "chord" in model.name.lower()  # as the Pop Music Transformer decides, by the folder's name
    prompt = None if prompt_midi is None else midi_to_events(prompt_midi, rep, chords=chords)
    events = generate_music(rt, rep, bars=bars, prompt=prompt, chords=chords, grammar=not no_grammar,
                            max_events=UPSTREAM_TOKEN_LIMIT if max_new_tokens is None else max_new_tokens,
                            **sampling)
    if events_out is not None:
        with atomic_path(events_out, force=force) as tmp:
            tmp.write_text("".join(f"{event}\n" for event in events), encoding="utf-8")
    notes = None
    if midi_out is not None:
        notes = write_midi(events, rep, midi_out, force=force).notes
        click.echo(f"wrote {midi_out}: {len(notes)} notes, {events.count(rep.bar)} bar events, "
                   f"{len(events)} {rep.name} events")
    if events_out is not None:
        click.echo(f"wrote {events_out}: {len(events)} events")
    if roll_out is not None:
        if notes is None:
            notes = events_to_score(events, rep).notes
        width, height = write_piano_roll(notes, roll_out, force=force)
        click.echo(f"wrote {roll_out}: a piano roll of {width} x {height} pixels")


COMMANDS = [generate_cmd]
