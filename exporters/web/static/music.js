// A music model's events as notes, placed as each project's own MIDI writer places them, one event at a time: the
// rules of txl_deploy/music/events_to_midi.py (docs/music.md, "Events to MIDI"), which the page's piano roll and
// player read. Ticks: 480 a beat, 1920 a bar.
export const TICKS_PER_BEAT = 480;
export const TICKS_PER_BAR = 1920;
export const DEFAULT_BPM = 120; // where the events set no tempo at tick 0, as the MIDI file written in Python
const TICKS_PER_POSITION = 120;
const VELOCITY_STEP = 4;
const DURATION_STEP = 60;
const TEMPO_CLASS_START = { slow: 30, mid: 90, fast: 150 };

const integer = (low, high) => (text) =>
  /^[0-9]{1,7}$/.test(text) && Number(text) >= low && Number(text) <= high ? Number(text) : null;
const none = (text) => (text === "None" ? text : null);
const marker = (text) => (/^[!-~]{1,64}$/.test(text) ? text : null);

// Each representation's event names (longest first where one begins another) and how a value is read.
const REPRESENTATIONS = {
  remi: {
    "Bar": none,
    "Position": (text) => {
      const m = /^([0-9]{1,2})\/16$/.exec(text);
      return m && Number(m[1]) >= 1 && Number(m[1]) <= 16 ? Number(m[1]) - 1 : null;
    },
    "Note Velocity": integer(0, 31),
    "Note On": integer(0, 127),
    "Note Duration": integer(0, 63),
    "Tempo Class": (text) => (Object.hasOwn(TEMPO_CLASS_START, text) ? text : null),
    "Tempo Value": integer(0, 59),
    "Chord": marker,
  },
  "remi-xl": {
    "Bar": none,
    "EOS": none,
    "Beat": integer(0, 15),
    "Note_Pitch": integer(0, 127),
    "Note_Velocity": integer(0, 127),
    "Note_Duration": integer(0, 1 << 20),
    "Tempo": integer(4, 1000),
    "Chord": (text) => {
      const parts = text.split("_");
      return parts.length === 2 && parts.every(Boolean) && marker(text) ? text : null;
    },
  },
};

// Events pushed one at a time; `notes` ({start, end, pitch, velocity} in ticks), `tempos` ([tick, bpm]) and
// `markers` ([tick, text]) grow as the writer would place them. A group is placed once the three events after its
// first are known, as the writer reads each event with the three after it; after remi-xl's EOS_None nothing is.
export class Placer {
  constructor(representation) {
    if (!Object.hasOwn(REPRESENTATIONS, representation)) {
      throw new Error(`unknown music representation ${JSON.stringify(representation)}`);
    }
    this.name = representation;
    this.values = REPRESENTATIONS[representation];
    this.names = Object.keys(this.values);
    this.parsed = []; // [name, value] of each event, special symbols left out
    this.pushed = 0; // events pushed, special symbols included (for the error's index)
    this.notes = [];
    this.tempos = [];
    this.markers = [];
    this.next = 0; // the first parsed event not yet placed
    this.end = Infinity; // remi-xl: where EOS_None is
    this.bar = 0;
    this.now = 0;
  }

  // The bars reached so far (bar lines at 0, 1920, ... up to this many bars).
  get bars() {
    return this.name === "remi" ? this.bar + 1 : this.bar;
  }

  // Add one event symbol; returns the notes this placed. An event not of this representation throws.
  push(symbol) {
    const index = this.pushed++;
    if (symbol.startsWith("<") && symbol.endsWith(">")) return [];
    const name = this.names.find((n) => symbol.startsWith(n + "_"));
    const value = name === undefined ? null : this.values[name](symbol.slice(name.length + 1));
    if (value === null) throw new Error(`event ${index}: ${JSON.stringify(symbol.slice(0, 80))} is not a ${this.name} event`);
    if (name === "EOS" && this.end === Infinity) this.end = this.parsed.length;
    this.parsed.push([name, value]);
    const before = this.notes.length;
    const limit = Math.min(this.parsed.length - 3, this.end);
    for (; this.next < limit; this.next++) {
      if (this.name === "remi") this.placeRemi(this.next);
      else this.placeRemiXl(this.next);
    }
    return this.notes.slice(before);
  }

  pushAll(symbols) {
    for (const s of symbols) this.push(s);
    return this;
  }

  follows(i, ...names) {
    return names.every((name, k) => this.parsed[i + k][0] === name);
  }

  placeRemi(i) {
    const [name, value] = this.parsed[i];
    const p = this.parsed;
    if (name === "Bar") {
      if (i > 0) this.bar += 1;
      return;
    }
    if (name !== "Position") return;
    const start = this.bar * TICKS_PER_BAR + value * TICKS_PER_POSITION;
    if (this.follows(i, "Position", "Note Velocity", "Note On", "Note Duration")) {
      this.notes.push({ start, end: start + DURATION_STEP * (p[i + 3][1] + 1), pitch: p[i + 2][1],
                        velocity: VELOCITY_STEP * p[i + 1][1] });
    } else if (this.follows(i, "Position", "Chord")) {
      this.markers.push([start, p[i + 1][1]]);
    } else if (this.follows(i, "Position", "Tempo Class", "Tempo Value")) {
      this.tempos.push([start, TEMPO_CLASS_START[p[i + 1][1]] + p[i + 2][1]]);
    }
  }

  placeRemiXl(i) {
    const [name, value] = this.parsed[i];
    const p = this.parsed;
    if (name === "Bar") this.bar += 1;
    else if (name === "Beat") this.now = this.bar * TICKS_PER_BAR + value * TICKS_PER_POSITION;
    else if (name === "Chord") this.markers.push([this.now, value]);
    else if (name === "Tempo") this.tempos.push([this.now, value]);
    else if (this.follows(i, "Note_Pitch", "Note_Velocity", "Note_Duration")) {
      const duration = p[i + 2][1];
      this.notes.push({ start: this.now, end: this.now + (duration || DURATION_STEP), pitch: p[i][1],
                        velocity: p[i + 1][1] });
    }
  }

  // Seconds at a tick under the tempo changes placed (120 bpm until the first, as in the MIDI file).
  seconds(tick) {
    const changes = [...this.tempos].sort((a, b) => a[0] - b[0]);
    let t = 0, at = 0, bpm = DEFAULT_BPM;
    for (const [when, to] of changes) {
      if (when >= tick) break;
      t += ((when - at) / TICKS_PER_BEAT) * (60 / bpm);
      [at, bpm] = [when, to];
    }
    return t + ((tick - at) / TICKS_PER_BEAT) * (60 / bpm);
  }
}
