"""Valid music by construction: the REMI and remi-xl grammars (txl_deploy/music/grammar.py) allow exactly the event
orders the projects' MIDI writers place, and a tiny model generating under them writes sequences in which no event
is dropped.

`placed_remi` and `placed_remi_xl` are this test's own reading of the upstream writers (YatingMusic/remi utils.py
`write_midi`; compound-word-transformer remi-xl `wrtie_midi`), written from their code, not from the grammar: which
events of a sequence end up in the MIDI file.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers.event_models import REMI_SYMBOLS, REMI_XL_SYMBOLS, SYMBOLS, save_event_model

from txl_deploy.errors import InputError
from txl_deploy.music.events_to_midi import events_to_score
from txl_deploy.music.grammar import GrammarState, compiled, constraint


def placed_remi(events) -> list[bool]:
    """Per event: does write_midi place it? Bars count; a Position places only the group it opens whole (Note
    Velocity, Note On, Note Duration; Chord; Tempo Class, Tempo Value). Positions within a bar never go back."""
    names = [e.split("_")[0] for e in events]
    placed = [False] * len(events)
    at = 0
    for i, name in enumerate(names):
        if name == "Bar":
            placed[i], at = True, 0
        elif name == "Position":
            k = int(events[i].split("_")[1].split("/")[0])
            groups = (["Note Velocity", "Note On", "Note Duration"], ["Chord"], ["Tempo Class", "Tempo Value"])
            for group in groups:
                if names[i + 1:i + 1 + len(group)] == group and k >= at:
                    for j in range(i, i + 1 + len(group)):
                        placed[j] = True
                    at = k
    return placed


def placed_remi_xl(events) -> list[bool]:
    """Per event: does wrtie_midi place it where it belongs? Bars and EOS count; a Beat sets the time, increasing
    within a bar; a Chord or Tempo lands at the last Beat, which must be in this bar; a note is Note_Pitch,
    Note_Velocity, Note_Duration in that order, after a Beat of this bar."""
    placed = [False] * len(events)
    beat = -1
    for i, e in enumerate(events):
        parts = e.split("_")
        if parts[0] in ("Bar", "EOS"):
            placed[i] = True
            beat = -1 if parts[0] == "Bar" else beat
        elif parts[0] == "Beat":
            placed[i] = int(parts[1]) > beat
            beat = int(parts[1])
        elif parts[0] in ("Chord", "Tempo"):
            placed[i] = beat >= 0 and (parts[0] == "Tempo" or len(parts) == 3)
        elif e.startswith("Note_Pitch") and beat >= 0 and i + 2 < len(events) and \
                events[i + 1].startswith("Note_Velocity") and events[i + 2].startswith("Note_Duration"):
            placed[i] = placed[i + 1] = placed[i + 2] = True
    return placed


def test_the_remi_grammar_allows_what_write_midi_places():
    g = compiled("remi", REMI_SYMBOLS)
    ids = lambda events: [REMI_SYMBOLS.index(e) for e in events]  # noqa: E731
    good = ["Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_3", "Position_1/16", "Chord_C:maj",
            "Position_1/16", "Note Velocity_12", "Note On_60", "Note Duration_3", "Position_1/16", "Note Velocity_12",
            "Note On_64", "Note Duration_3", "Position_9/16", "Note Velocity_15", "Note On_67", "Note Duration_7",
            "Bar_None", "Bar_None", "Position_2/16", "Chord_N:N", "Bar_None"]
    assert g.first_error(ids(good)) is None and all(placed_remi(good))
    for bad, at in ((["Position_1/16"], 0),  # a piece opens with a Bar
                    (["Bar_None", "Note Velocity_12"], 1),  # a note needs its Position
                    (["Bar_None", "Position_3/16", "Note On_60"], 2),  # ... and its velocity first
                    (["Bar_None", "Position_3/16", "Note Velocity_12", "Note On_60", "Position_4/16"], 4),
                    (["Bar_None", "Position_3/16", "Chord_N:N", "Position_2/16"], 3),  # back in time
                    (["Bar_None", "Position_3/16", "Tempo Class_mid", "Bar_None"], 3),
                    (["Bar_None", "Position_17/16"], 1), (["Bar_None", "Position_1/16", "Note Velocity_12",
                                                           "Note On_200"], 3)):
        assert g.first_error(ids(bad)) == at, bad


def test_the_remi_xl_grammar_allows_what_its_writer_places():
    g = compiled("remi-xl", REMI_XL_SYMBOLS)
    ids = lambda events: [REMI_XL_SYMBOLS.index(e) for e in events]  # noqa: E731
    good = ["Bar_None", "Beat_0", "Chord_C_M", "Tempo_90", "Note_Pitch_60", "Note_Velocity_48", "Note_Duration_240",
            "Note_Pitch_64", "Note_Velocity_48", "Note_Duration_0", "Beat_4", "Chord_N_N", "Bar_None", "Bar_None",
            "Beat_15", "Tempo_60", "Bar_None", "EOS_None", "Bar_None"]
    assert g.first_error(ids(good)) is None and all(placed_remi_xl(good))
    for bad, at in ((["Bar_None", "Note_Pitch_60"], 1),  # an event before the bar's first Beat
                    (["Bar_None", "Beat_4", "Beat_4"], 2), (["Bar_None", "Beat_4", "Note_Pitch_60", "Beat_5"], 3),
                    (["Bar_None", "Beat_4", "Tempo_90", "Chord_C_M"], 3), (["Bar_None", "Beat_4", "Chord_broken"], 2),
                    (["Bar_None", "Beat_3", "Beat_2"], 2), (["EOS_None"], 0)):
        assert g.first_error(ids(bad)) == at, bad


def test_a_prompt_sets_the_state_and_a_state_goes_on_across_calls():
    ids = [REMI_SYMBOLS.index(e) for e in ("Bar_None", "Position_5/16", "Note Velocity_12")]
    state = constraint("remi", REMI_SYMBOLS, ids)
    assert {REMI_SYMBOLS[t] for t in np.flatnonzero(state.allowed())} == {f"Note On_{p}" for p in range(55, 80)}
    for event in ("Note On_60", "Note Duration_2"):
        state.advance(REMI_SYMBOLS.index(event))
    assert constraint(state, REMI_SYMBOLS) is state
    allowed = {REMI_SYMBOLS[t] for t in np.flatnonzero(state.allowed())}
    assert allowed == {"Bar_None"} | {f"Position_{k}/16" for k in range(5, 17)}


def test_refusals_are_one_line():
    with pytest.raises(InputError, match="unknown grammar 'abc': expected one of remi, remi-xl"):
        constraint("abc", REMI_SYMBOLS)
    with pytest.raises(InputError, match="needs the model's vocabulary"):
        constraint("remi", None)
    # a vocabulary without the events a grammar needs is refused when compiled, not in the middle of a piece
    no_duration = [s for s in REMI_SYMBOLS if not s.startswith("Note Duration")]
    with pytest.raises(InputError, match="cannot continue after 'Note On' .* none of Note Duration") as e:
        compiled("remi", no_duration)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="needs a vocabulary of remi events; this one.s symbols are not music events"):
        compiled("remi", [f"w{i}" for i in range(20)])
    with pytest.raises(InputError, match="compiled for"):
        constraint(constraint("remi", REMI_SYMBOLS), REMI_SYMBOLS[:-1])


NAMES = ["Bar", "Position", "Note Velocity", "Note On", "Note Duration", "Tempo Class", "Tempo Value", "Chord", "EOS",
         "Beat", "Note_Pitch", "Note_Velocity", "Note_Duration", "Tempo"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), st.text(max_size=6)), min_size=1, max_size=40),
       st.lists(st.integers(-3, 60), max_size=30))
def test_any_vocabulary_compiles_or_is_refused_in_one_line(events, ids):
    """Symbols are untrusted (they come with a checkpoint): any list compiles, or is an InputError, and any ids
    (a prompt) are followed without a crash."""
    symbols = list(dict.fromkeys(f"{name}_{value}" for name, value in events))
    for name in ("remi", "remi-xl"):
        try:
            g = compiled(name, symbols)
        except InputError as e:
            assert "\n" not in str(e)
            continue
        state = g.start([i for i in ids if 0 <= i < len(symbols)])
        assert state.allowed().shape == (len(symbols),) and state.allowed().any()
        g.first_error(ids)


@pytest.fixture(scope="module", params=["remi", "remi-xl"])
def music_runtime(request, tmp_path_factory):
    """A tiny model whose vocabulary is one representation's events, with an adaptive softmax (so decisions are
    cluster-factored), on the PyTorch reference."""
    from txl_deploy.runtimes import TxlRuntime

    folder = save_event_model(tmp_path_factory.mktemp("music") / request.param, request.param)
    return request.param, SYMBOLS[request.param], TxlRuntime.load(folder)


def _generate(rt, prompt, n, **kw):
    rt.reset()
    return [int(t) for t in rt.generate(prompt, max_new_tokens=n, **kw)]


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=1.2, top_k=10),
                                      dict(temperature=0.9, top_p=0.9, repetition_penalty=1.2)],
                         ids=["T=1", "top_k", "top_p+penalty"])
def test_generated_music_parses_and_the_writer_places_every_event(music_runtime, sampling):
    name, symbols, rt = music_runtime
    prompt = [symbols.index("Bar_None")]
    out = _generate(rt, prompt, 250, seed=5, grammar=name, **sampling)
    g = compiled(name, symbols)
    assert g.first_error(prompt + out) is None
    events = [symbols[t] for t in prompt + out]
    placed = (placed_remi if name == "remi" else placed_remi_xl)(events)
    # the writers read a group whole: one still open at the end of the sequence is the only thing left out
    open_at_end = len(placed) - placed[::-1].index(True) if True in placed else 0
    assert all(placed[:open_at_end]) and len(events) - open_at_end <= 3
    # unconstrained, the same model writes events that would be dropped (so the test can fail)
    free = [symbols[t] for t in prompt + _generate(rt, prompt, 250, seed=5, **sampling)]
    assert not all((placed_remi if name == "remi" else placed_remi_xl)(free))


def test_masked_seeded_generation_is_deterministic_and_goes_on_across_calls(music_runtime):
    name, symbols, rt = music_runtime
    prompt = [symbols.index("Bar_None")]
    a = _generate(rt, prompt, 60, seed=2, temperature=1.1, grammar=name)
    assert a == _generate(rt, prompt, 60, seed=2, temperature=1.1, grammar=name)
    rt.reset()
    state = compiled(name, symbols).start(prompt)
    first = list(rt.generate(prompt, max_new_tokens=30, seed=2, temperature=1.1, grammar=state))
    more = list(rt.generate(max_new_tokens=30, seed=3, temperature=1.1, grammar=state))
    assert compiled(name, symbols).first_error(prompt + first + more) is None
    assert isinstance(state, GrammarState)


def test_generate_with_a_grammar_is_refused_in_one_line(music_runtime, ref_rt):
    name, _, rt = music_runtime
    with pytest.raises(InputError, match="unknown grammar"):
        rt.generate([0], grammar="midi")
    with pytest.raises(InputError, match="symbols are not music events"):
        ref_rt.generate([0], grammar=name)  # a word model's vocabulary has no events


# values at the edges of what each writer reads (tests/music/test_events_to_midi.py: the writer's own refusals)
EDGE_VALUES = {"remi": ["Note Velocity_0", "Note Velocity_31", "Note Velocity_32", "Note Duration_63",
                        "Note Duration_64", "Tempo Value_59", "Tempo Value_60", "Position_16/16", "Position_0/16",
                        "Chord_C maj", "Chord_\u00e9", "Chord_" + "x" * 64, "Chord_" + "x" * 65, "Tempo Class_presto"],
               "remi-xl": ["Tempo_3", "Tempo_4", "Tempo_1000", "Tempo_1001", "Note_Duration_1048576",
                           "Note_Duration_1048577", "Beat_15", "Beat_16", "Chord_C M_x", "Chord_\u00e9_M",
                           "Note_Velocity_127", "Note_Velocity_128"]}


@pytest.mark.parametrize("name", ["remi", "remi-xl"])
def test_the_grammar_allows_a_value_exactly_when_the_writer_places_it(name):
    """Generating under the grammar never gives an event the MIDI writer refuses: each symbol is allowed somewhere
    exactly when events_to_score reads it."""
    symbols = list(dict.fromkeys(SYMBOLS[name] + EDGE_VALUES[name]))
    g = compiled(name, symbols)
    for v, symbol in enumerate(symbols):
        try:
            events_to_score([symbol], name)
            writable = True
        except InputError:
            writable = False
        assert (g.kind[v] >= 0) == writable, symbol
