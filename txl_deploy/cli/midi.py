"""`txl-deploy midi`: a music model's events as a MIDI file, or a MIDI file as its events."""

from __future__ import annotations

from pathlib import Path

import click

from txl_deploy.cli.options import ModelReference, local_model, model_vocab, vocab_options
from txl_deploy.errors import InputError
from txl_deploy.files import atomic_path
from txl_deploy.music.events_to_midi import write_midi
from txl_deploy.music.midi_to_events import midi_to_events
from txl_deploy.music.representation import REPRESENTATIONS, Representation, detect, of_vocab, representation

MIDI_SUFFIXES = (".mid", ".midi")
MAX_EVENTS_BYTES = 16 << 20  # an events file is read whole; a song's events are some kilobytes


def model_representation(model: Path, name: str | None, **how) -> Representation:
    """The event representation of `model`: `name` if given, else what its vocabulary's symbols are."""
    if name is not None:
        return representation(name)
    vocab = model_vocab(model, **how)
    if vocab is None:
        raise InputError(f"{model}: has no vocabulary to tell its events by (pass --representation)")
    found = of_vocab(vocab) or detect(vocab.symbols)
    if found is None:
        raise InputError(f"{model}: its vocabulary is not one of music events ({', '.join(REPRESENTATIONS)}); "
                         "pass --representation to read the events as one")
    return found


def read_events(path: Path) -> list[str]:
    """The events of a text file, one a line (kept whole: REMI's hold spaces); blank lines skipped."""
    try:
        size = path.stat().st_size
        if size > MAX_EVENTS_BYTES:
            raise InputError(f"{path}: {size:,} bytes is too large for an events file (at most "
                             f"{MAX_EVENTS_BYTES:,})")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


@click.command()
@click.argument("model", type=ModelReference(click.Path(exists=True, path_type=Path)))
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The MIDI file (from events) or the events file, one event a line (from MIDI).")
@click.option("--chords/--no-chords", default=None,
              help="From MIDI: add chord events (REMI's rule-based chords), as the chord model's prompts have them. "
                   "[default: on when MODEL's name says chord, as the Pop Music Transformer decides]")
@click.option("--force", is_flag=True, help="Overwrite the output if it exists.")
@vocab_options
def midi(model, source, out, chords, force, config, preset, vocab, vocab_kind, representation):
    """Write a music model's events (SOURCE: a text file, one event a line) as a MIDI file, or a MIDI file
    (SOURCE ending .mid or .midi) as the events the model reads.

    MODEL (a checkpoint, an .onnx or a .pte) says the representation: REMI (the Pop Music Transformer) or remi-xl
    (Compound Word Transformer's REMI baseline), told from its vocabulary's events; --representation overrides it.
    Events are placed as each project's own writer places them (480 ticks a beat, 16 positions a bar; an incomplete
    note is dropped, as theirs drop it). MIDI is read for REMI, as its project extracts a prompt's events: notes on
    the 16th grid, tempo on the beats, chords with --chords. Needs the music extra (mido).

    \b
    Example:
      txl-deploy midi REMI-tempo-checkpoint events.txt -o song.mid
      txl-deploy midi REMI-tempo-chord-checkpoint prompt.mid -o prompt.txt
      txl-deploy midi model.onnx events.txt -o song.mid --representation remi-xl
    """
    model = local_model(model)
    how = {"config": config, "preset": preset, "vocab": vocab, "vocab_kind": vocab_kind}
    rep = model_representation(model, representation, **{k: v for k, v in how.items() if v is not None})
    if source.suffix.lower() in MIDI_SUFFIXES:
        if chords is None:
            chords = "chord" in model.name.lower()
        events = midi_to_events(source, rep, chords=chords)
        with atomic_path(out, force=force) as tmp:
            tmp.write_text("".join(f"{event}\n" for event in events), encoding="utf-8")
        click.echo(f"wrote {out}: {len(events)} {rep.name} events, {events.count(rep.bar)} bars"
                   f"{', with chords' if chords else ''}")
        return
    score = write_midi(read_events(source), rep, out, force=force)
    click.echo(f"wrote {out}: {len(score.notes)} notes, {len(score.tempos)} tempo changes, "
               f"{len(score.markers)} chord markers ({rep.name})")


COMMANDS = [midi]
