// A music model's notes on the page: a piano roll drawn on a canvas that widens as bars arrive, and a player
// that schedules them with WebAudio (an oscillator and a gain envelope per note; no plug-in, no network).
// Where the notes are placed is music.js's business; this file only shows and sounds them.
import { TICKS_PER_BAR } from "./music.js";

const PX_PER_BAR = 96;
const MIN_PITCH_SPAN = 24;

// Draw `placer`'s notes on `canvas`: time across (a bar line every bar), pitch up, darker for louder.
export function drawRoll(canvas, placer) {
  const bars = Math.max(placer.bars, 1);
  const width = Math.max(canvas.parentElement ? canvas.parentElement.clientWidth : 0, 400, bars * PX_PER_BAR + 1);
  if (canvas.width !== width) canvas.width = width; // the roll grows with the piece
  const g = canvas.getContext("2d");
  g.fillStyle = "#fcfcfa";
  g.fillRect(0, 0, canvas.width, canvas.height);
  let low = 60, high = 72; // the middle of the keyboard until there are notes
  if (placer.notes.length) [low, high] = [128, -1];
  for (const n of placer.notes) [low, high] = [Math.min(low, n.pitch), Math.max(high, n.pitch)];
  const pad = Math.max(0, MIN_PITCH_SPAN - (high - low)) / 2;
  low = Math.floor(low - pad - 1);
  high = Math.ceil(high + pad + 1);
  const rowH = canvas.height / (high - low + 1);
  const x = (tick) => (tick / TICKS_PER_BAR) * PX_PER_BAR;
  g.strokeStyle = "#bbb";
  g.lineWidth = 1;
  for (let b = 0; b <= bars; b++) {
    g.beginPath();
    g.moveTo(Math.floor(x(b * TICKS_PER_BAR)) + 0.5, 0);
    g.lineTo(Math.floor(x(b * TICKS_PER_BAR)) + 0.5, canvas.height);
    g.stroke();
  }
  for (const n of placer.notes) {
    g.fillStyle = `hsl(212, 50%, ${70 - 40 * (n.velocity / 127)}%)`;
    g.fillRect(x(n.start), (high - n.pitch) * rowH, Math.max(x(n.end) - x(n.start), 2), Math.max(rowH - 1, 1));
  }
}

// Schedule `placer`'s notes on an AudioContext from now; returns {context, scheduled, seconds}. Gain follows the
// note's velocity; times follow the tempo changes the events placed.
export function play(placer, context = new AudioContext()) {
  const out = context.createGain();
  out.gain.value = 0.3;
  out.connect(context.destination);
  const t0 = context.currentTime + 0.1;
  let scheduled = 0, last = 0;
  for (const n of placer.notes) {
    const start = t0 + placer.seconds(n.start), end = t0 + placer.seconds(n.end);
    const osc = context.createOscillator();
    osc.type = "triangle";
    osc.frequency.value = 440 * 2 ** ((n.pitch - 69) / 12);
    const env = context.createGain();
    const peak = Math.max(n.velocity / 127, 0.001);
    env.gain.setValueAtTime(0, start);
    env.gain.linearRampToValueAtTime(peak, start + 0.01);
    env.gain.setTargetAtTime(peak * 0.6, start + 0.01, 0.1); // a piano-like decay while held
    env.gain.setTargetAtTime(0, end, 0.05); // and a short release
    osc.connect(env).connect(out);
    osc.start(start);
    osc.stop(end + 0.3);
    scheduled += 1;
    last = Math.max(last, end + 0.3 - t0);
  }
  return { context, scheduled, seconds: last };
}
