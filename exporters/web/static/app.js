// The demo page: loads the model with onnxruntime-web, streams generated text, shows per-token latency.
// The model-specific part is txl.js; this file is only the page around it.
import * as ort from "onnxruntime-web";
import { TxlStream, Vocab, sample } from "./txl.js";

const $ = (id) => document.getElementById(id);
const site = JSON.parse($("site-config").textContent);
const params = new URLSearchParams(location.search);

async function start() {
  // The wasm binary is fetched here, with its subresource-integrity hash, and handed to onnxruntime-web.
  const wasm = await fetch(site.ort.wasm, { integrity: site.ort.wasm_integrity, mode: "cors" });
  if (!wasm.ok) throw new Error(`${site.ort.wasm}: HTTP ${wasm.status}`);
  ort.env.wasm.wasmBinary = await wasm.arrayBuffer();
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
  return { stream, spec, vocab: new Vocab(vocab), provider: providers[0] };
}

const ready = start();
let stopRequested = false;

// Generate after `prompt` into a fresh memory; calls onToken(id, ms) as each token arrives.
async function generate(prompt, maxNew, temperature, topK, onToken) {
  const { stream, vocab } = await ready;
  stream.reset();
  const ids = vocab.encode(prompt);
  if (ids.length === 0) throw new Error("the prompt is empty");
  let t = performance.now();
  let logProbs = await stream.step(ids, { lastOnly: true });
  const out = [];
  for (let n = 0; n < maxNew && !stopRequested; n++) {
    const id = sample(logProbs, temperature, topK);
    out.push(id);
    const now = performance.now();
    await onToken(id, now - t);
    t = performance.now();
    if (n + 1 < maxNew) logProbs = await stream.step([id]);
  }
  return out;
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
  const { vocab } = await ready;
  const prompt = $("prompt").value;
  const temperature = Number($("temperature").value);
  const topK = Number($("top-k").value);
  const maxNew = Number($("max-new").value);
  $("prompt-echo").textContent = prompt;
  $("generated").textContent = "";
  $("generate").disabled = true;
  $("stop").disabled = false;
  document.body.dataset.state = "generating";
  stopRequested = false;
  const ms = [];
  const decoder = vocab.streamDecoder(prompt); // a character over several byte tokens shows once complete
  try {
    await generate(prompt, maxNew, temperature, topK, async (id, elapsed) => {
      $("generated").textContent += decoder.feed(id);
      ms.push(elapsed);
      const sorted = [...ms].sort((a, b) => a - b);
      const median = sorted[Math.floor(sorted.length / 2)];
      $("latency").textContent = `token ${ms.length}: ${elapsed.toFixed(1)} ms · median ${median.toFixed(1)} ms ` +
        `· ${(1000 / median).toFixed(0)} tokens/s`;
      drawLatency(ms);
      await nextFrame(); // let the browser paint each token as it comes
    });
    $("generated").textContent += decoder.flush();
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
ready.then(() => { $("generate").disabled = false; document.body.dataset.state = "ready"; },
           (e) => { $("status").textContent = `error: ${e.message}`; document.body.dataset.state = "error"; });

// For scripts and tests: greedy generation and raw log-probs on a fresh memory, with the page's own stream.
window.txlDemo = {
  ready: ready.then(({ spec, provider }) => ({ precision: spec.precision, provider })),
  async greedy(prompt, maxNew) {
    return generate(prompt, maxNew, 0, 0, async () => {});
  },
  async greedyText(prompt, maxNew) { // the text the page shows for greedy generation, piece by piece
    const { vocab } = await ready;
    const decoder = vocab.streamDecoder(prompt);
    const pieces = [];
    await generate(prompt, maxNew, 0, 0, async (id) => { pieces.push(decoder.feed(id)); });
    pieces.push(decoder.flush());
    return pieces;
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
