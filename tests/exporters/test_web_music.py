"""The browser page's notes (exporters/web/static/music.js `Placer`), run in Node.js as the other txl.js tests are:
event lists pushed one at a time place the notes, tempo changes and markers Python's events_to_midi places, for
REMI and remi-xl, on hand-made lists (incomplete groups, a group in the last three events, remi-xl's EOS_None,
special symbols) and on random ones; and an event that is not the representation's is refused, as in Python."""

from __future__ import annotations

import json
import random
import shutil
import subprocess

import pytest
from helpers.browser import need

from txl_deploy.exporters.web.site import _template_dir
from txl_deploy.music.events_to_midi import events_to_score

NODE = shutil.which("node") or shutil.which("nodejs")

RUNNER = """
import { Placer } from "./music.mjs";
import { readFileSync } from "node:fs";
const cases = JSON.parse(readFileSync(process.argv[2], "utf8"));
const out = cases.map(({ representation, events }) => {
  const placer = new Placer(representation);
  const growing = []; // notes placed after each event: never one taken back
  try {
    for (const e of events) growing.push(placer.push(e).length);
  } catch (e) {
    return { error: e.message };
  }
  const notes = placer.notes.map((n) => [n.start, n.end, n.pitch, n.velocity]);
  return { notes, tempos: placer.tempos, markers: placer.markers, growing,
           seconds: notes.map(([start]) => placer.seconds(start)) };
});
console.log(JSON.stringify(out));
"""

REMI_EVENTS = (["Bar_None", "<eos>"] + [f"Position_{k}/16" for k in range(1, 17)]
               + [f"Note Velocity_{v}" for v in (0, 10, 31)] + [f"Note On_{p}" for p in (0, 60, 127)]
               + [f"Note Duration_{d}" for d in (0, 7, 63)] + ["Chord_C:maj", "Chord_N:N"]
               + [f"Tempo Class_{c}" for c in ("slow", "mid", "fast")] + [f"Tempo Value_{n}" for n in (0, 30, 59)])
REMI_XL_EVENTS = (["Bar_None", "EOS_None", "<pad>"] + [f"Beat_{k}" for k in range(16)] + ["Chord_C_M", "Chord_N_N"]
                  + [f"Tempo_{t}" for t in (4, 90, 1000)] + [f"Note_Pitch_{p}" for p in (0, 60, 127)]
                  + [f"Note_Velocity_{v}" for v in (0, 64, 127)] + [f"Note_Duration_{d}" for d in (0, 120, 1920)])

HAND_MADE = {
    "remi": [
        ["Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_30", "Position_1/16", "Chord_C:maj",
         "Position_1/16", "Note Velocity_20", "Note On_60", "Note Duration_7", "Bar_None", "Position_5/16",
         "Note Velocity_10", "Note On_64", "Note Duration_3", "Position_9/16", "Note Velocity_10", "Note On_67",
         "Bar_None", "Position_9/16", "Note Velocity_31", "Note On_72", "Note Duration_63", "Bar_None"],
        ["Position_3/16", "Note Velocity_5", "Note On_50", "Note Duration_1"],  # the last three start nothing
        ["Bar_None", "Position_2/16", "Tempo Class_fast", "Position_2/16", "Note Velocity_5", "Note On_50",
         "Note Duration_1", "Bar_None"],
    ],
    "remi-xl": [
        ["Bar_None", "Beat_0", "Tempo_90", "Chord_C_M", "Note_Pitch_60", "Note_Velocity_64", "Note_Duration_0",
         "Beat_4", "Note_Pitch_64", "Note_Velocity_64", "Note_Duration_480", "Bar_None", "Beat_8", "Tempo_150",
         "Note_Pitch_67", "Note_Velocity_100", "Note_Duration_1920", "Beat_12", "Note_Pitch_72", "Note_Velocity_50",
         "Note_Duration_120", "EOS_None", "Bar_None", "Beat_0", "Note_Pitch_50", "Note_Velocity_50",
         "Note_Duration_120"],
        ["Bar_None", "Beat_2", "Note_Pitch_60", "Note_Velocity_64", "Note_Duration_240", "EOS_None"],
        ["Bar_None", "Beat_2", "Note_Pitch_60", "Note_Velocity_64", "Note_Duration_240", "Bar_None", "Beat_1"],
    ],
}


def _random_lists(representation, symbols, n, seed):
    rng = random.Random(seed)
    # mostly well-formed groups, with stray events between them, so both placed and skipped runs occur
    groups = {"remi": lambda: rng.choice([
        ["Bar_None"], [rng.choice(symbols[2:18]), rng.choice(symbols[18:21]), rng.choice(symbols[21:24]),
                       rng.choice(symbols[24:27])],
        [rng.choice(symbols[2:18]), rng.choice(symbols[27:29])],
        [rng.choice(symbols[2:18]), rng.choice(symbols[29:32]), rng.choice(symbols[32:35])],
        [rng.choice(symbols)]]),
        "remi-xl": lambda: rng.choice([
            ["Bar_None"], [rng.choice(symbols[3:19])], [rng.choice(symbols[19:21])], [rng.choice(symbols[21:24])],
            [rng.choice(symbols[24:27]), rng.choice(symbols[27:30]), rng.choice(symbols[30:33])],
            [rng.choice(symbols)]])}[representation]
    return [[e for _ in range(rng.randrange(0, 40)) for e in groups()] for _ in range(n)]


def _python(events, representation):
    score = events_to_score(events, representation)
    return {"notes": [[n.start, n.end, n.pitch, n.velocity] for n in score.notes],
            "tempos": [list(t) for t in score.tempos], "markers": [list(m) for m in score.markers]}


def _seconds(tick, tempos):
    # a tick's time under the tempo map a MIDI player reads: 120 bpm until the first change
    t, at, bpm = 0.0, 0, 120
    for when, to in sorted(tempos, key=lambda c: c[0]):
        if when >= tick:
            break
        t, at, bpm = t + (when - at) / 480 * 60 / bpm, when, to
    return t + (tick - at) / 480 * 60 / bpm


def test_music_js_places_notes_as_events_to_midi_does(tmp_path):
    need(NODE is not None, "no Node.js (apt-get install nodejs)")
    cases = [dict(representation=r, events=e) for r, lists in HAND_MADE.items() for e in lists]
    cases += [dict(representation="remi", events=e) for e in _random_lists("remi", REMI_EVENTS, 60, 1)]
    cases += [dict(representation="remi-xl", events=e) for e in _random_lists("remi-xl", REMI_XL_EVENTS, 60, 2)]
    cases += [dict(representation="remi", events=["Bar_None", "Note On_200"]),
              dict(representation="remi-xl", events=["Bar_None", "<pad>", "Beat_16"]),
              dict(representation="remi-xl", events=["Note On_60"])]
    shutil.copyfile(_template_dir() / "music.js", tmp_path / "music.mjs")
    (tmp_path / "run.mjs").write_text(RUNNER)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = subprocess.run([NODE, "run.mjs", "cases.json"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    placed = 0
    for case, got in zip(cases, json.loads(r.stdout), strict=True):
        events, representation = case["events"], case["representation"]
        try:
            want = _python(events, representation)
        except Exception as e:  # noqa: BLE001 - a refused list must be refused in the page too, saying which event
            assert got == {"error": str(e).replace("'", '"')}, (representation, events)
            continue
        assert {k: got[k] for k in want} == want, (representation, events)
        assert got["seconds"] == pytest.approx([_seconds(n[0], want["tempos"]) for n in want["notes"]])
        assert sum(got["growing"]) == len(want["notes"])
        placed += len(want["notes"])
    assert placed > 200  # the random lists place many notes, not just the hand-made ones
