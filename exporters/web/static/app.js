// The demo page: loads the model with onnxruntime-web, streams generated text, shows per-token latency; for a
// music model also the notes as a piano roll, and plays them (music.js places them, pianoroll.js shows and sounds).
// The model-specific part is txl.js; this file is only the page around it.
import { Placer } from "./music.js";
import { drawRoll, play } from "./pianoroll.js";
import { Clusters, Grammar, Pcg64, Sampler, SamplingParams, StopText, TxlStream, Vocab } from "./txl.js";

const $ = (id) => document.getElementById(id);
const site = JSON.parse($("site-config").textContent);
const params = new URLSearchParams(location.search);
const SLOW_RUNTIME_MS = 8000; // then the page says where it is waiting for onnxruntime-web, and what else to do

// What to do when onnxruntime-web cannot be loaded: from the CDN, a site with its own copy; a local copy, its files.
function runtimeHint() {
  if (site.ort.module.startsWith("./")) {
    return "The site's ort/ folder is incomplete: write the site again with txl-deploy web-demo ... --ort-web DIR.";
  }
  return "Without access to the CDN, write the site with a local copy of onnxruntime-web: " +
    `npm install onnxruntime-web@${site.ort.version}, then txl-deploy web-demo MODEL.onnx -o SITE ` +
    "--ort-web node_modules/onnxruntime-web.";
}

// onnxruntime-web, imported here rather than at the top of this module: a runtime that cannot be fetched (no
// network, the CDN blocked) would otherwise stop the whole page before it runs, leaving it loading for ever.
async function loadRuntime() {
  const slow = setTimeout(() => {
    $("status").textContent = `still waiting for onnxruntime-web from ${site.ort.module} ... ${runtimeHint()}`;
  }, SLOW_RUNTIME_MS);
  try {
    const ort = await import("onnxruntime-web");
    // The wasm binary is fetched here, with its subresource-integrity hash, and handed to onnxruntime-web.
    const wasm = await fetch(site.ort.wasm, { integrity: site.ort.wasm_integrity, mode: "cors" });
    if (!wasm.ok) throw new Error(`${site.ort.wasm}: HTTP ${wasm.status}`);
    ort.env.wasm.wasmBinary = await wasm.arrayBuffer();
    return ort;
  } catch (e) {
    throw new Error(`onnxruntime-web could not be loaded from ${site.ort.module} (${e.message}). ${runtimeHint()}`);
  } finally {
    clearTimeout(slow);
  }
}

async function start() {
  $("status").textContent = `loading onnxruntime-web ${site.ort.version} from ${site.ort.module} ...`;
  const ort = await loadRuntime();
  $("status").textContent = "loading the model ...";
  ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
  const [spec, vocab] = await Promise.all([fetch("model.json").then((r) => r.json()),
                                           fetch("vocab.json").then((r) => r.json())]);
  // WebGPU where the browser has it (and the graph is not int4, whose MatMulNBits runs best on wasm), else wasm;
  // ?ep=wasm or ?ep=webgpu chooses.
  const wanted = params.get("ep") || (navigator.gpu && spec.precision !== "int4" ? "webgpu" : "wasm");
  const providers = wanted === "webgpu" ? ["webgpu", "wasm"] : ["wasm"];
  const t0 = performance.now();
  const stream = await TxlStream.load(ort, "model.onnx", spec, { executionProviders: providers });
  const info = `${spec.name}: ${spec.precision}, ${spec.n_layer} layers, mem_len ${spec.mem_len}, ` +
    `${spec.n_token} tokens · onnxruntime-web ${site.ort.version} (${providers[0]}) · loaded in ` +
    `${Math.round(performance.now() - t0)} ms`;
  $("status").textContent = info;
  // a music model (one whose vocabulary is a representation's events, so the exporter wrote its grammar): the page
  // also places its events as notes, draws them and plays them
  const representation = spec.grammar ? spec.grammar.name : null;
  if (representation) $("music").hidden = false;
  // an adaptive softmax's layout: its tokens are then sampled cluster by cluster, as Python samples them
  return { stream, spec, vocab: new Vocab(vocab), clusters: Clusters.of(spec), grammar: Grammar.of(spec),
           provider: providers[0], representation };
}

const ready = start();
let stopRequested = false;
let placer = null; // the notes of the piece generated last (music models)
let player = null; // what Play scheduled last

// A music model's piece: the prompt's events and then each generated one placed as notes (music.js) and drawn.
// Events the representation cannot place (a prompt of other words) leave the roll empty and say why.
function startPiece(representation, symbols) {
  placer = new Placer(representation);
  window.txlNotes = placer.notes;
  const piece = {
    add(symbol) {
      if (placer === null) return;
      try {
        placer.push(symbol);
      } catch (e) {
        $("music-status").textContent = `not placed: ${e.message}`;
        placer = null;
        return;
      }
      drawRoll($("piano-roll"), placer);
      $("roll-box").scrollLeft = $("roll-box").scrollWidth; // follow the newest bar
      $("music-status").textContent = `${placer.notes.length} notes, ${placer.bars} bars` +
        (placer.end < Infinity ? " (EOS_None ended the piece: what follows is not placed)" : "");
    },
  };
  $("play").disabled = false;
  for (const s of symbols) piece.add(s);
  drawRoll($("piano-roll"), placer ?? new Placer(representation));
  return piece;
}

function onPlay() {
  if (player) player.context.close();
  player = null;
  if (placer === null) return;
  player = play(placer);
  window.txlAudio = { context: player.context, scheduled: player.scheduled };
  $("music-status").textContent = `playing ${player.scheduled} notes (${player.seconds.toFixed(1)} s)`;
  return player;
}

// Generate after `prompt` into a fresh memory with the shared sampler (txl.js, the Python sampler's twin): tokens
// until params.maxTokens, a stop token id or a stop string. Calls onToken(id, text, ms) as each token arrives, with
// the text that may be shown now (decoded incrementally; a possible stop string is held back, the match itself is
// never shown), and once more with id null for what is left when the page's Stop ended it early.
async function generate(prompt, params, stops, onToken) {
  const { stream, spec, vocab, clusters, grammar, representation } = await ready;
  stream.reset();
  const ids = vocab.encode(prompt);
  if (ids.length === 0) throw new Error("the prompt is empty");
  const piece = representation ? startPiece(representation, ids.map((id) => vocab.symbols[id])) : null;
  // a music model samples only the events its grammar allows next, so its MIDI writer places every one
  const sampler = new Sampler(params, spec.n_token, ids, null, vocab, clusters, grammar ? grammar.start(ids) : null);
  const stopText = new StopText(stops);
  const decoder = vocab.streamDecoder(prompt); // a character over several byte tokens shows once complete
  const finish = () => { // the decoder's rest (an incomplete last character) and what the stop check held back
    const [rest, hit] = stopText.push(decoder.flush(), true);
    return hit ? rest : rest + stopText.flush();
  };
  let t = performance.now();
  let logProbs = await stream.step(ids, { lastOnly: true });
  const out = [];
  let finished = false;
  for (let n = 0; n < params.maxTokens && !stopRequested; n++) {
    const id = sampler.choose(logProbs);
    out.push(id);
    if (piece) piece.add(vocab.symbols[id]);
    let text, hit;
    if (params.stopTokenIds.includes(id)) [text, hit] = [finish(), true];
    else [text, hit] = stopText.push(decoder.feed(id), out.length >= params.minTokens);
    if (!hit && n + 1 === params.maxTokens) text += finish();
    finished = hit || n + 1 === params.maxTokens;
    const now = performance.now();
    await onToken(id, text, now - t);
    t = performance.now();
    if (hit) break;
    if (n + 1 < params.maxTokens) logProbs = await stream.step([id]);
  }
  if (!finished) { // stopped from the page: what is left, with no new token (id null)
    const rest = finish();
    if (rest) await onToken(null, rest, 0);
  }
  return out;
}

// The page's controls as sampling parameters; a value out of range throws (and the page says so).
function readControls() {
  const num = (id) => Number($(id).value);
  const seed = $("seed").value.trim();
  const params = new SamplingParams({
    temperature: num("temperature"), topK: num("top-k") || null, topP: num("top-p"), minP: num("min-p"),
    repetitionPenalty: num("repetition-penalty"), presencePenalty: num("presence-penalty"),
    frequencyPenalty: num("frequency-penalty"), noRepeatNgramSize: num("no-repeat-ngram"),
    seed: seed === "" ? null : Number(seed), maxTokens: num("max-new"), banUnk: $("ban-unk").checked,
  });
  return { params, stops: $("stop-text").value ? [$("stop-text").value] : [] };
}

const nextFrame = () => new Promise((resolve) => requestAnimationFrame(() => resolve()));

function drawLatency(ms) {
  const canvas = $("latency-plot");
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const top = Math.max(...ms) || 1;
  const w = canvas.width / Math.max(ms.length, 1);
  g.fillStyle = "#3b6ea5";
  ms.forEach((m, i) => {
    const h = (m / top) * (canvas.height - 2);
    g.fillRect(i * w, canvas.height - h, Math.max(w - 1, 1), h);
  });
}

async function onGenerate() {
  await ready;
  const prompt = $("prompt").value;
  $("prompt-echo").textContent = prompt;
  $("generated").textContent = "";
  $("generate").disabled = true;
  $("stop").disabled = false;
  document.body.dataset.state = "generating";
  stopRequested = false;
  const ms = [];
  try {
    const { params, stops } = readControls();
    await generate(prompt, params, stops, async (id, text, elapsed) => {
      $("generated").textContent += text;
      if (id === null) return;
      ms.push(elapsed);
      const sorted = [...ms].sort((a, b) => a - b);
      const median = sorted[Math.floor(sorted.length / 2)];
      $("latency").textContent = `token ${ms.length}: ${elapsed.toFixed(1)} ms · median ${median.toFixed(1)} ms ` +
        `· ${(1000 / median).toFixed(0)} tokens/s`;
      drawLatency(ms);
      await nextFrame(); // let the browser paint each token as it comes
    });
  } catch (e) {
    $("status").textContent = `error: ${e.message}`;
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    document.body.dataset.state = "done";
  }
}

$("generate").addEventListener("click", onGenerate);
$("stop").addEventListener("click", () => { stopRequested = true; });
$("play").addEventListener("click", onPlay);
ready.then(() => { $("generate").disabled = false; document.body.dataset.state = "ready"; },
           (e) => { $("status").textContent = `error: ${e.message}`; document.body.dataset.state = "error"; });

// For scripts and tests: greedy generation and raw log-probs on a fresh memory, with the page's own stream.
window.txlDemo = {
  ready: ready.then(({ spec, provider }) => ({ precision: spec.precision, provider })),
  async greedy(prompt, maxNew) {
    return generate(prompt, new SamplingParams({ temperature: 0, maxTokens: maxNew }), [], async () => {});
  },
  // the page's generation with any sampling parameters (SamplingParams' fields) and stop strings: [ids, text]
  async generate(prompt, fields, stops = []) {
    let text = "";
    const ids = await generate(prompt, new SamplingParams(fields), stops, async (id, piece) => { text += piece; });
    return [ids, text];
  },
  // the sampler alone (the model's clusters, if any): tokens chosen from given log-prob rows; the generator's first
  // uniform numbers
  async sampleRows(rows, fields, context = []) {
    const { vocab, clusters } = await ready;
    const sampler = new Sampler(new SamplingParams(fields), rows[0].length, context, null, vocab, clusters);
    return rows.map((row) => sampler.choose(row));
  },
  uniforms(seed, n) {
    const g = new Pcg64(seed);
    return Array.from({ length: n }, () => g.random());
  },
  async greedyText(prompt, maxNew) { // the text the page shows for greedy generation, piece by piece
    const pieces = [];
    await generate(prompt, new SamplingParams({ temperature: 0, maxTokens: maxNew }), [],
                   async (id, text) => { pieces.push(text); });
    return pieces;
  },
  // a music model's Play: {state, scheduled} of the AudioContext it scheduled the notes on
  play() {
    const p = onPlay();
    return p ? { state: p.context.state, scheduled: p.scheduled } : null;
  },
  async encode(text) {
    return (await ready).vocab.encode(text);
  },
  async decodeStream(ids) { // each id's piece, then the flush
    const decoder = (await ready).vocab.streamDecoder();
    return [...ids.map((id) => decoder.feed(id)), decoder.flush()];
  },
  async logProbs(segments) { // segments: arrays of token ids fed one after another; returns one array each
    const { stream } = await ready;
    stream.reset();
    const out = [];
    for (const segment of segments) out.push(Array.from(await stream.step(segment)));
    return out;
  },
};
