// txl.js: run a txl-deploy Transformer-XL export with onnxruntime-web, the memory threaded between calls.
//
// This is the graph contract (docs/graph-contract.md) in JavaScript, for one stream (batch 1):
//   inputs   tokens [1, Q] int64, out_positions [1, P] int64,
//            mem_k.i [1, n_head, d_head, mem_len], mem_v.i [1, n_head, mem_len, d_head] (float32 or float16),
//            mem_count [1] int64: tokens consumed since the reset; stream position p lives in ring slot p % mem_len
//   outputs  log_probs [1, P, n_token] float32, then per layer
//            new_k.i [1, H, d_head, Q], new_v.i [1, H, Q, d_head]            (state "incremental": we write
//                                                                              them into the ring ourselves)
//            or next_mem_k.i, next_mem_v.i and next_mem_count (state "full": the whole next state, swapped in)
// The all-zero state is the empty memory. An incremental graph also takes a 1-slot memory while nothing has
// been consumed, which spares a prompt the scores against mem_len masked slots.
// `spec` is the model.json that `txl-deploy web-demo` writes beside the model (read from the ONNX metadata).
// Copy this file into your app as it is; it needs nothing but onnxruntime-web.

export class TxlStream {
  constructor(ort, session, spec) {
    this.ort = ort;
    this.session = session;
    this.spec = spec;
    this.reset();
  }

  static async load(ort, modelUrl, spec, sessionOptions = {}) {
    const session = await ort.InferenceSession.create(modelUrl, sessionOptions);
    return new TxlStream(ort, session, spec);
  }

  // Forget the memory: zeroed ring buffers and a count of 0.
  reset() {
    const { n_layer, n_head, d_head, mem_len } = this.spec;
    const Buffer = this.spec.float_dtype === "float16" ? Uint16Array : Float32Array; // fp16 kept as raw bits
    this.count = 0;
    this.k = [];
    this.v = [];
    for (let i = 0; i < n_layer; i++) {
      this.k.push(new Buffer(n_head * d_head * mem_len));
      this.v.push(new Buffer(n_head * mem_len * d_head));
    }
  }

  // Feed token ids; returns log-probs [P, n_token] as one Float32Array (P = the number of ids, or 1 with
  // lastOnly). Segments longer than the graph's max_segment go in pieces, with the same result.
  async step(ids, { lastOnly = false } = {}) {
    if (ids.length === 0) throw new RangeError("step() needs at least one token id");
    const pieces = [];
    for (let start = 0; start < ids.length; start += this.spec.max_segment) {
      const segment = ids.slice(start, start + this.spec.max_segment);
      const last = start + this.spec.max_segment >= ids.length;
      const out = await this.run(segment, lastOnly ? [segment.length - 1] : segment.map((_, j) => j));
      if (!lastOnly || last) pieces.push(out);
    }
    if (pieces.length === 1) return pieces[0];
    const all = new Float32Array(pieces.reduce((n, p) => n + p.length, 0));
    pieces.reduce((offset, p) => (all.set(p, offset), offset + p.length), 0);
    return all;
  }

  async run(segment, positions) {
    const { ort, spec } = this;
    const { n_layer, n_head, d_head, mem_len } = spec;
    const Q = segment.length;
    for (const id of segment) {
      if (!Number.isInteger(id) || id < 0 || id >= spec.n_token) {
        throw new RangeError(`token id ${id} is outside the vocabulary [0, ${spec.n_token})`);
      }
    }
    const float = spec.float_dtype;
    const slots = spec.fresh_prefill && this.count === 0 ? 1 : mem_len;
    const feeds = {
      tokens: new ort.Tensor("int64", BigInt64Array.from(segment, BigInt), [1, Q]),
      out_positions: new ort.Tensor("int64", BigInt64Array.from(positions, BigInt), [1, positions.length]),
      mem_count: new ort.Tensor("int64", BigInt64Array.of(BigInt(this.count)), [1]),
    };
    for (let i = 0; i < n_layer; i++) {
      const k = slots === mem_len ? this.k[i] : new this.k[i].constructor(n_head * d_head);
      const v = slots === mem_len ? this.v[i] : new this.v[i].constructor(n_head * d_head);
      feeds[`mem_k.${i}`] = new ort.Tensor(float, k, [1, n_head, d_head, slots]);
      feeds[`mem_v.${i}`] = new ort.Tensor(float, v, [1, n_head, slots, d_head]);
    }
    const out = await this.session.run(feeds);
    // Commit the memory only now that the run has succeeded.
    for (let i = 0; i < n_layer; i++) {
      if (spec.state === "full") {
        this.k[i].set(bits(out[`next_mem_k.${i}`].data));
        this.v[i].set(bits(out[`next_mem_v.${i}`].data));
      } else {
        this.writeRing(i, bits(out[`new_k.${i}`].data), bits(out[`new_v.${i}`].data), Q);
      }
    }
    this.count += Q;
    const logProbs = out.log_probs.data;
    for (const tensor of Object.values(out)) if (tensor.data !== logProbs) tensor.dispose?.();
    return logProbs;
  }

  // Entry j of this segment goes to slot (count + j) % mem_len; of a segment longer than the memory only the
  // last mem_len entries survive.
  writeRing(i, newK, newV, Q) {
    const { n_head, d_head, mem_len: M } = this.spec;
    const K = this.k[i], V = this.v[i];
    for (let j = Math.max(0, Q - M); j < Q; j++) {
      const slot = (this.count + j) % M;
      for (let h = 0; h < n_head; h++) {
        for (let d = 0; d < d_head; d++) K[(h * d_head + d) * M + slot] = newK[(h * d_head + d) * Q + j];
        const row = (h * Q + j) * d_head;
        V.set(newV.subarray(row, row + d_head), (h * M + slot) * d_head);
      }
    }
  }
}

// fp16 tensors may come back as Float16Array: copy their raw bits, never convert them.
function bits(data) {
  return typeof Float16Array !== "undefined" && data instanceof Float16Array
    ? new Uint16Array(data.buffer, data.byteOffset, data.length)
    : data;
}

// The model's vocabulary (vocab.json), as txl_deploy.vocab.Vocab reads and writes text. Kinds: "word" (words split
// on whitespace, <eos> at line ends), "char" (one symbol per character), "bytes" (the paper's enwik8: each symbol
// a byte's decimal value; text is UTF-8 and newlines are dropped, as its preprocessing dropped them) and "text8"
// (a-z, "_" for the space). Another kind (from a newer txl-deploy) is refused, never read as one of these. A word
// vocabulary read with the Moses tokenizer (tokenizer "wikitext" or "lm1b": WikiText-103's and One Billion Word's
// models) is refused too: the page has no Moses, and splitting on whitespace would give the model other words.
const KINDS = ["word", "char", "bytes", "text8"];
const UNK = "<unk>", EOS = "<eos>";

export class Vocab {
  constructor({ kind, symbols, tokenizer = null }) {
    if (!KINDS.includes(kind)) {
      throw new Error(`vocabulary kind ${JSON.stringify(kind)} is not one this txl.js knows (${KINDS.join(", ")})`);
    }
    if (kind === "word" && tokenizer !== null && tokenizer !== "whitespace") {
      throw new Error(`this model reads and writes text with the ${tokenizer} tokenizer (Moses), which the page ` +
        "does not have; run it with txl-deploy generate or serve");
    }
    this.kind = kind;
    this.symbols = symbols;
    this.index = new Map(symbols.map((s, i) => [s, i]));
    this.unk = this.index.get(UNK);
    this.eos = this.index.get(EOS);
    if (kind === "bytes") {
      this.byteIds = new Int32Array(256).fill(-1);  // byte value -> id
      this.byteOf = symbols.map((s) => (/^(0|[1-9][0-9]{0,2})$/.test(s) && Number(s) < 256 ? Number(s) : -1));
      this.byteOf.forEach((b, i) => { if (b >= 0) this.byteIds[b] = i; });
    }
  }

  // Text -> token ids. A symbol the vocabulary lacks becomes <unk> where it has one, else a RangeError naming it.
  encode(text) {
    if (this.kind === "bytes") return this.encodeBytes(new TextEncoder().encode(text));
    if (this.kind === "text8") return this.encodeText8(text);
    let pieces;
    if (this.kind === "char") {
      pieces = Array.from(text);
    } else { // words; <eos> at every line end, not after an unterminated last line
      pieces = [];
      const lines = text.split("\n");
      lines.forEach((line, n) => {
        pieces.push(...line.split(/\s+/).filter(Boolean));
        if (this.eos !== undefined && n < lines.length - 1) pieces.push(EOS);
      });
    }
    return pieces.map((p) => this.lookup(p, () => `symbol ${JSON.stringify(p)} is not in the vocabulary`));
  }

  lookup(piece, problem) {
    const id = this.index.get(piece) ?? this.unk;
    if (id === undefined) throw new RangeError(problem());
    return id;
  }

  // UTF-8 bytes -> ids: a newline is dropped unless the vocabulary holds byte 10 (or <eos>).
  encodeBytes(bytes) {
    const ids = [];
    bytes.forEach((b, at) => {
      let id = this.byteIds[b];
      if (id < 0 && b === 10) {
        if (this.eos === undefined) return;
        id = this.eos;
      }
      if (id < 0) {
        id = this.lookup(null, () => `byte ${b} at byte ${at} of the prompt is not in this model's byte vocabulary`);
      }
      ids.push(id);
    });
    return ids;
  }

  // A space is "_"; other whitespace is dropped (a newline is <eos> where the vocabulary has one).
  encodeText8(text) {
    const ids = [];
    for (const c of text) {
      const problem = () => `character ${JSON.stringify(c)} is not in this text8 vocabulary, which holds ` +
        "lowercase a-z and spaces only";
      if (c === " ") ids.push(this.lookup("_", problem));
      else if (/\s/.test(c)) { if (c === "\n" && this.eos !== undefined) ids.push(this.eos); }
      else ids.push(this.lookup(c === "_" ? null : c, problem));
    }
    return ids;
  }

  // Incremental decoding of generated ids: feed(id) returns the text to show now, flush() the rest at the end. A
  // character spelled over several byte tokens comes out once complete; bytes that are not UTF-8 become U+FFFD.
  // `after` is the text the stream continues (a word then gets its leading space).
  streamDecoder(after = "") {
    return new StreamDecoder(this, after);
  }

  // Text of one generated token as it continues a stream: words get a leading space, <eos> a newline. Whole
  // symbols only: a byte vocabulary spells a character over several tokens, so use streamDecoder() there.
  piece(id) {
    if (this.kind === "char") return this.symbols[id];
    if (this.kind !== "word") return this.streamDecoder().feed(id);
    return id === this.eos ? "\n" : " " + this.symbols[id];
  }
}

// What txl_deploy.vocab.StreamDecoder does, in JavaScript (the two agree on every stream, invalid bytes included:
// both replace as Unicode's "maximal subpart" practice says).
export class StreamDecoder {
  constructor(vocab, after = "") {
    this.vocab = vocab;
    this.last = after.slice(-1);
    this.utf8 = vocab.kind === "bytes" ? new TextDecoder("utf-8") : null;
  }

  feed(id) {
    const { vocab } = this;
    if (!Number.isInteger(id) || id < 0 || id >= vocab.symbols.length) {
      throw new RangeError(`token id ${id} is outside the vocabulary [0, ${vocab.symbols.length})`);
    }
    const symbol = vocab.symbols[id];
    let text;
    if (vocab.kind === "bytes") {
      const b = vocab.byteOf[id];
      if (b >= 0) text = this.utf8.decode(Uint8Array.of(b), { stream: true });
      else if (symbol === EOS) text = this.utf8.decode(Uint8Array.of(10), { stream: true });
      else text = this.utf8.decode() + "\ufffd"; // <unk> ends any character in progress
    } else if (vocab.kind === "text8") {
      text = symbol === "_" ? " " : symbol === EOS ? "\n" : symbol === UNK ? "\ufffd" : symbol;
    } else if (vocab.kind === "char") {
      text = symbol;
    } else if (id === vocab.eos) {
      text = "\n";
    } else {
      text = !this.last || /\s/.test(this.last) ? symbol : " " + symbol;
    }
    if (text) this.last = text.slice(-1);
    return text;
  }

  flush() {
    if (!this.utf8) return "";
    const text = this.utf8.decode();
    if (text) this.last = text.slice(-1);
    return text;
  }
}

// -- sampling: txl_deploy/runtimes/sampling/, step for step -------------------------------------------------------
// The same parameters, checked the same way (a bad value throws RangeError), the same steps in the same order, in
// float64, with sums in the same order, and the same uniform numbers: `Pcg64` is numpy's default_rng(seed)
// (SeedSequence, then PCG64 XSL-RR, random() = (next64 >> 11) / 2^53), so a seeded page samples the tokens that
// TxlRuntime.generate and the HTTP server sample from the same log-probs. A model with an adaptive softmax (its
// `Clusters`, from model.json's clusters) is sampled as Python samples it, by the cluster-factored decision of
// docs/sampling.md: decided on the head (the shortlist's log-probs and each tail cluster's log-sum-exp, computed
// from the full row as Clusters.head_from_full computes it, numpy's pairwise sum included) and the tail clusters
// it asks for, consuming the generator as Python does (one uniform per block draw, two more when a hidden
// cluster's block is hit). Math.exp and Math.log may differ from numpy's in the last bit, so a decision that falls
// within that rounding of a boundary can go the other way; nothing else differs.

const MASK32 = 0xffffffff;
const M128 = (1n << 128n) - 1n;
const M64 = (1n << 64n) - 1n;
const PCG_MULT = (2549297995355413924n << 64n) + 4865540595714422341n;

// numpy's SeedSequence(seed).generate_state(4, uint64) for a whole-number seed (pool of 4 uint32 words).
function seedSequenceState(seed) {
  const u32 = (x) => x >>> 0;
  const mul = (a, b) => u32(Math.imul(a, b));
  let entropy = [];
  for (let v = BigInt(seed); v > 0n; v >>= 32n) entropy.push(Number(v & 0xffffffffn));
  if (entropy.length === 0) entropy = [0];
  let hashA = 0x43b0d7e5;
  const hashmix = (value) => {
    value = u32(value ^ hashA);
    hashA = mul(hashA, 0x931e8875);
    value = mul(value, hashA);
    return u32(value ^ (value >>> 16));
  };
  const mix = (x, y) => {
    const r = u32(mul(0xca01f9dd, x) - mul(0x4973f715, y));
    return u32(r ^ (r >>> 16));
  };
  const pool = [0, 0, 0, 0].map((_, i) => hashmix(i < entropy.length ? entropy[i] : 0));
  for (let src = 0; src < 4; src++) {
    for (let dst = 0; dst < 4; dst++) if (src !== dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  }
  for (let src = 4; src < entropy.length; src++) {
    for (let dst = 0; dst < 4; dst++) pool[dst] = mix(pool[dst], hashmix(entropy[src]));
  }
  let hashB = 0x8b51f9dd;
  const words = [];
  for (let i = 0; i < 8; i++) {
    let v = u32(pool[i % 4] ^ hashB);
    hashB = mul(hashB, 0x58f38ded);
    v = mul(v, hashB);
    words.push(u32(v ^ (v >>> 16)));
  }
  return [0, 1, 2, 3].map((k) => (BigInt(words[2 * k + 1]) << 32n) | BigInt(words[2 * k]));
}

// numpy's PCG64 bit generator: random() gives what np.random.default_rng(seed).random() gives, draw by draw.
export class Pcg64 {
  constructor(seed) {
    if (!Number.isSafeInteger(seed) || seed < 0) throw new RangeError(`seed must be a whole number in [0, 2^53), got ${seed}`);
    const [s0, s1, i0, i1] = seedSequenceState(seed);
    this.inc = ((((i0 << 64n) | i1) << 1n) | 1n) & M128;
    this.state = 0n;
    this.step();
    this.state = (this.state + ((s0 << 64n) | s1)) & M128;
    this.step();
  }

  step() {
    this.state = (this.state * PCG_MULT + this.inc) & M128;
  }

  next64() {
    this.step();
    const x = ((this.state >> 64n) ^ this.state) & M64;
    const rot = this.state >> 122n;
    return ((x >> rot) | (x << ((64n - rot) & 63n))) & M64;
  }

  random() {
    return Number(this.next64() >> 11n) / 9007199254740992;
  }
}

const whole = (name, v, lo) => {
  if (!Number.isInteger(v) || v < lo) throw new RangeError(`${name} must be a whole number >= ${lo}, got ${v}`);
  return v;
};
const inRange = (name, v, lo, hi, loOpen = false) => {
  if (typeof v !== "number" || !Number.isFinite(v) || v < lo || v > hi || (loOpen && v === lo)) {
    throw new RangeError(`${name} must be in ${loOpen ? "(" : "["}${lo}, ${hi}], got ${v}`);
  }
  return v;
};

// What SamplingParams holds (the token-level controls), under the same names in camelCase.
export class SamplingParams {
  constructor({ temperature = 1, topK = null, topP = 1, minP = 0, repetitionPenalty = 1, presencePenalty = 0,
                frequencyPenalty = 0, noRepeatNgramSize = 0, logitBias = {}, seed = null, stopTokenIds = [],
                maxTokens = 16, minTokens = 0, banUnk = false } = {}) {
    if (typeof temperature !== "number" || !Number.isFinite(temperature) || temperature < 0) {
      throw new RangeError(`temperature must be a finite number >= 0, got ${temperature}`);
    }
    this.temperature = temperature;
    this.topK = topK === null ? null : whole("top_k", topK, 1);
    this.topP = inRange("top_p", topP, 0, 1, true);
    this.minP = inRange("min_p", minP, 0, 1);
    if (typeof repetitionPenalty !== "number" || !Number.isFinite(repetitionPenalty) || repetitionPenalty <= 0) {
      throw new RangeError(`repetition_penalty must be a finite number > 0, got ${repetitionPenalty}`);
    }
    this.repetitionPenalty = repetitionPenalty;
    this.presencePenalty = inRange("presence_penalty", presencePenalty, -2, 2);
    this.frequencyPenalty = inRange("frequency_penalty", frequencyPenalty, -2, 2);
    this.noRepeatNgramSize = whole("no_repeat_ngram_size", noRepeatNgramSize, 0);
    this.logitBias = new Map(Object.entries(logitBias).map(([k, b]) => {
      const id = Number(k);
      whole("a logit_bias key", id, 0);
      return [id, inRange(`logit_bias[${id}]`, b, -100, 100)];
    }));
    this.seed = seed === null ? null : whole("seed", seed, 0);
    this.stopTokenIds = stopTokenIds.map((id) => whole("stop token id", id, 0));
    this.maxTokens = whole("max_tokens", maxTokens, 0);
    this.minTokens = whole("min_tokens", minTokens, 0);
    if (this.minTokens > this.maxTokens) {
      throw new RangeError(`min_tokens (${this.minTokens}) must not exceed max_tokens (${this.maxTokens})`);
    }
    if (typeof banUnk !== "boolean") throw new RangeError(`ban_unk must be true or false, got ${banUnk}`);
    this.banUnk = banUnk;
  }
}

// The tokens that would complete an n-gram already in `ids` (HuggingFace's no_repeat_ngram_size).
export function bannedNgramTokens(ids, n) {
  if (n < 1 || ids.length + 1 < n) return [];
  const prefix = ids.slice(ids.length - n + 1);
  const out = new Set();
  for (let i = 0; i + n <= ids.length; i++) {
    let same = true;
    for (let j = 0; j < n - 1 && same; j++) same = ids[i + j] === prefix[j];
    if (same) out.add(ids[i + n - 1]);
  }
  return [...out].sort((a, b) => a - b);
}

// numpy's sum of a float64 array (np.sum): pairwise, in blocks of 8 accumulators up to 128 numbers, halves above.
export function pairwiseSum(a, lo = 0, n = a.length - lo) {
  if (n < 8) {
    let res = 0;
    for (let i = 0; i < n; i++) res += a[lo + i];
    return res;
  }
  if (n <= 128) {
    const r = [];
    for (let j = 0; j < 8; j++) r.push(a[lo + j]);
    let i = 8;
    for (; i < n - (n % 8); i += 8) for (let j = 0; j < 8; j++) r[j] += a[lo + i + j];
    let res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) res += a[lo + i];
    return res;
  }
  let n2 = Math.floor(n / 2);
  n2 -= n2 % 8;
  return pairwiseSum(a, lo, n2) + pairwiseSum(a, lo + n2, n - n2);
}

// The adaptive softmax's layout, read from model.json's `clusters` (written by the exporter: Clusters.to_dict of
// txl_deploy/contract/clusters.py): tokens [0, shortlist) are in the head, tail cluster i = 1..n covers
// bounds[i - 1] = [lo, hi), and its probability is head column headColumns[i - 1].
export class Clusters {
  constructor(shortlist, bounds, headColumns) {
    this.shortlist = shortlist;
    this.bounds = bounds;
    this.headColumns = headColumns;
  }

  // The layout a model.json lists (`clusters`, with its `n_token`), or null for a plain softmax (none listed).
  // A layout that is not one (gaps, empty clusters, head columns outside the head or repeated) is refused.
  static of(spec) {
    const c = spec.clusters ?? null;
    if (c === null) return null;
    const whole = (x) => Number.isInteger(x) && x >= 0;
    const bounds = Array.isArray(c.bounds) ? c.bounds : [];
    const ends = [0, c.shortlist, ...bounds.map((b) => (Array.isArray(b) ? b[1] : NaN))];
    const columns = Array.isArray(c.headColumns ?? c.head_columns) ? (c.headColumns ?? c.head_columns) : [];
    const head = c.shortlist + bounds.length;
    const ok = whole(c.shortlist) && bounds.length > 0 && ends.at(-1) === spec.n_token &&
      bounds.every((b, k) => Array.isArray(b) && b.length === 2 && b[0] === ends[k + 1]) &&
      ends.every((e, k) => whole(e) && (k === 0 || e > ends[k - 1])) &&
      columns.length === bounds.length && new Set(columns).size === columns.length &&
      columns.every((col) => Number.isInteger(col) && col >= c.shortlist && col < head);
    if (!ok) {
      throw new RangeError(`model.json's clusters are not an adaptive softmax's layout of ${spec.n_token} tokens: ` +
        JSON.stringify(c).slice(0, 120));
    }
    return new Clusters(c.shortlist, bounds.map((b) => [b[0], b[1]]), [...columns]);
  }

  get n() { return this.bounds.length; }

  get nToken() { return this.bounds[this.n - 1][1]; }

  // Cluster i's column in the head, as the metadata lists it.
  headColumn(i) { return this.headColumns[i - 1]; }

  // The head [shortlist + n] of a full distribution [V] as Clusters.head_from_full computes it: the shortlist's
  // log-probs and per cluster the log of its tokens' total probability (a max-shifted log-sum-exp with numpy's
  // pairwise sum), each rounded to float32 as the head graph's output is.
  headFromFull(logProbs) {
    if (logProbs.length !== this.nToken) {
      throw new RangeError(`log-probs have ${logProbs.length} entries, the vocabulary ${this.nToken}`);
    }
    const head = new Float64Array(this.shortlist + this.n);
    for (let j = 0; j < this.shortlist; j++) head[j] = Math.fround(logProbs[j]);
    this.bounds.forEach(([lo, hi], k) => {
      let top = -Infinity;
      for (let t = lo; t < hi; t++) if (logProbs[t] > top || Number.isNaN(logProbs[t])) top = logProbs[t];
      if (!Number.isFinite(top)) { head[this.headColumn(k + 1)] = top; return; }
      const e = new Float64Array(hi - lo);
      for (let t = lo; t < hi; t++) e[t - lo] = Math.exp(logProbs[t] - top);
      head[this.headColumn(k + 1)] = Math.fround(top + Math.log(pairwiseSum(e)));
    });
    return head;
  }
}

// Relative slack on a hidden cluster's mass bound (runtimes/sampling/bounds.py's MASS_MARGIN).
const MASS_MARGIN = 1e-4;
const NOTHING_LEFT = "no token is left to choose: the sampling parameters exclude every token";

// An upper bound of the sum of n probabilities (summing to at most 1) raised to 1/T (runtimes/sampling/bounds.py's power_sum_bound).
const powerSumBound = (n, T) => (T <= 1 ? 1 : n ** (1 - 1 / T));

// Of the clusters `can`, the one with the largest key (ties: the lowest i), as Python's max(can, key=(k, -i)).
function largest(can, key) {
  let best = can[0];
  for (const i of can) if (key[i - 1] > key[best - 1] || (key[i - 1] === key[best - 1] && i < best)) best = i;
  return best;
}

function sortedKeys(map) {
  return [...map.keys()].sort((a, b) => a - b);
}

// Valid music by construction (txl_deploy/music/grammar.py): the grammar model.json carries (`grammar`: its event
// names, which follow which, each token's event and bar position), compiled here to one mask per (last event name,
// position in the bar), as Python compiles it. Grammar.of(spec) is null for a model without one.
export class Grammar {
  constructor({ name, names, follows, kind, position, position_kind, bar, repeat_position, n_positions }) {
    const V = kind.length, P = n_positions + 1;
    Object.assign(this, { name, names, kind, position, positionKind: position_kind, bar, P });
    this.masks = [];
    for (let n = 0; n < names.length; n++) {
      for (let p = 0; p < P; p++) {
        const mask = new Uint8Array(V);
        for (const f of follows[n]) {
          for (let v = 0; v < V; v++) {
            if (kind[v] !== f) continue;
            if (f !== position_kind || (repeat_position ? position[v] >= Math.max(p, 1) : position[v] > p)) {
              mask[v] = 1;
            }
          }
        }
        this.masks.push(mask);
      }
    }
  }

  static of(spec) {
    return spec.grammar ? new Grammar(spec.grammar) : null;
  }

  // A stream's state after `context` (token ids): the constraint a Sampler applies.
  start(context = []) {
    const state = new GrammarState(this);
    for (const t of context) state.advance(t);
    return state;
  }
}

export class GrammarState {
  constructor(grammar) {
    this.grammar = grammar;
    this.last = 0;
    this.at = 0;
  }

  allowed() {
    return this.grammar.masks[this.last * this.grammar.P + this.at];
  }

  advance(token) {
    const g = this.grammar, k = g.kind[token];
    if (k === undefined || k < 0) return; // not an event (a prompt's special symbol): the state stays
    this.at = k === g.positionKind ? g.position[token] : k === g.bar ? 0 : this.at;
    this.last = k;
  }
}

// One stream's sampling: choose(logProbs) -> token id. `random` (uniform in [0, 1)) defaults to Pcg64(seed), or
// Math.random without a seed. `vocab`: the model's Vocab, which banUnk needs (to find <unk>). `clusters`: the
// adaptive softmax's layout (Clusters.of(spec)); with it every decision is the cluster-factored one. `constraint`:
// the mask hook (allowed() -> a 0/1 mask [V] or null, advance(token)), e.g. a GrammarState; the tokens it leaves
// out get -inf after steps 1-5.
export class Sampler {
  constructor(params, nToken, context = [], random = null, vocab = null, clusters = null, constraint = null) {
    if (params.banUnk && vocab === null) {
      throw new RangeError("ban_unk needs the model's vocabulary, to know which token is <unk>");
    }
    this.unk = params.banUnk ? vocab.unk : undefined; // undefined: nothing to ban
    for (const [what, ids] of [["logit_bias", [...params.logitBias.keys()]], ["stop_token_ids", params.stopTokenIds]]) {
      const bad = ids.find((id) => id >= nToken);
      if (bad !== undefined) throw new RangeError(`${what} names token id ${bad}, outside the vocabulary [0, ${nToken})`);
    }
    if (clusters !== null && clusters.nToken !== nToken) {
      throw new RangeError(`the clusters cover ${clusters.nToken} tokens, the vocabulary ${nToken}`);
    }
    this.params = params;
    this.nToken = nToken;
    this.clusters = clusters;
    this.constraint = constraint;
    this.allowedNow = null; // the constraint's mask for the decision in progress
    this.context = Array.from(context);
    this.generated = [];
    this.counts = new Float64Array(nToken);
    if (random) this.random = random;
    else if (params.seed !== null) { const g = new Pcg64(params.seed); this.random = () => g.random(); }
    else this.random = Math.random;
  }

  scores(logProbs) {
    const p = this.params;
    const s = Float64Array.from(logProbs);
    for (const [id, b] of p.logitBias) s[id] += b;
    if (p.repetitionPenalty !== 1) {
      for (const id of new Set([...this.context, ...this.generated])) {
        s[id] = s[id] < 0 ? s[id] * p.repetitionPenalty : s[id] / p.repetitionPenalty;
      }
    }
    if (p.presencePenalty || p.frequencyPenalty) {
      for (let j = 0; j < s.length; j++) {
        const c = this.counts[j];
        s[j] = s[j] - c * p.frequencyPenalty - (c > 0 ? p.presencePenalty : 0);
      }
    }
    if (p.noRepeatNgramSize) {
      for (const id of bannedNgramTokens([...this.context, ...this.generated], p.noRepeatNgramSize)) s[id] = -Infinity;
    }
    if (p.minTokens && this.generated.length < p.minTokens) for (const id of p.stopTokenIds) s[id] = -Infinity;
    if (this.unk !== undefined) s[this.unk] = -Infinity;
    const allowed = this.allowedNow;
    if (allowed) for (let j = 0; j < s.length; j++) if (!allowed[j]) s[j] = -Infinity;
    return s;
  }

  choose(logProbs) {
    let id;
    this.allowedNow = this.constraint ? this.constraint.allowed() : null;
    if (this.allowedNow) {
      if (this.allowedNow.length !== this.nToken) {
        throw new RangeError(`a constraint's mask must have ${this.nToken} entries, got ${this.allowedNow.length}`);
      }
      if (!this.allowedNow.some((a) => a)) throw new RangeError(`${NOTHING_LEFT} (the constraint allows none)`);
    }
    if (this.clusters !== null) {
      id = this.chooseFactored(logProbs);
    } else {
      const p = this.params;
      const s = this.scores(logProbs);
      let best = 0;
      for (let i = 1; i < s.length; i++) if (s[i] > s[best]) best = i;
      if (!(s[best] > -Infinity)) throw new RangeError(NOTHING_LEFT);
      id = p.temperature === 0 ? best : draw(filteredWeights(s, p), this.random());
    }
    this.generated.push(id);
    this.counts[id] += 1;
    if (this.constraint) this.constraint.advance(id);
    return id;
  }

  // The cluster-factored decision on a full row: its head, and each tail cluster sliced from the row when asked.
  chooseFactored(logProbs) {
    const steps = this.factored(this.clusters.headFromFull(logProbs));
    let next = steps.next();
    while (!next.done) {
      const slice = (lo, hi) => (ArrayBuffer.isView(logProbs) ? logProbs.subarray(lo, hi) : logProbs.slice(lo, hi));
      const given = new Map(next.value.map((i) => [i, slice(...this.clusters.bounds[i - 1])]));
      next = steps.next(given);
    }
    return next.value;
  }

  // -- steps 1-5 token by token (Sampler._adjustments and _steps) ------------------------------------------------
  // This decision's adjustments: the ids each step touches, and every touched id, sorted.
  adjustments() {
    const p = this.params;
    const history = [...this.context, ...this.generated];
    const rep = p.repetitionPenalty !== 1 ? [...new Set(history)] : [];
    const banned = p.noRepeatNgramSize ? bannedNgramTokens(history, p.noRepeatNgramSize) : [];
    if (p.minTokens && this.generated.length < p.minTokens) banned.push(...p.stopTokenIds);
    if (this.unk !== undefined) banned.push(this.unk);
    const counted = [];
    if (p.presencePenalty || p.frequencyPenalty) this.counts.forEach((c, j) => { if (c > 0) counted.push(j); });
    const touched = [...new Set([...p.logitBias.keys(), ...rep, ...banned, ...counted])].sort((a, b) => a - b);
    return { rep, banned: [...new Set(banned)], counted, touched };
  }

  // Steps 1-5 on the tokens `ids` (sorted, or { lo, n } for the ids lo..lo + n - 1) with these log-probs: what
  // scores() gives them, element by element.
  steps(ids, values, adj) {
    const p = this.params;
    const s = ArrayBuffer.isView(values) ? new Float64Array(values) : Float64Array.from(values); // (a fast copy)
    const at = ids.lo !== undefined
      ? (id) => (id >= ids.lo && id < ids.lo + ids.n ? id - ids.lo : -1)
      : (id) => {
        let a = 0, b = ids.length;
        while (a < b) { const m = (a + b) >> 1; if (ids[m] < id) a = m + 1; else b = m; }
        return a < ids.length && ids[a] === id ? a : -1;
      };
    for (const [id, b] of p.logitBias) { const j = at(id); if (j >= 0) s[j] += b; }
    for (const id of adj.rep) {
      const j = at(id);
      if (j >= 0) s[j] = s[j] < 0 ? s[j] * p.repetitionPenalty : s[j] / p.repetitionPenalty;
    }
    for (const id of adj.counted) {
      const j = at(id), c = this.counts[id];
      if (j >= 0) s[j] = s[j] - c * p.frequencyPenalty - p.presencePenalty;
    }
    for (const id of adj.banned) { const j = at(id); if (j >= 0) s[j] = -Infinity; }
    const allowed = this.allowedNow;
    if (allowed) {
      for (let j = 0; j < s.length; j++) if (!allowed[ids.lo !== undefined ? ids.lo + j : ids[j]]) s[j] = -Infinity;
    }
    return s;
  }

  // -- the cluster-factored decision (sampling/factored.py, docs/sampling.md) -------------------------------------
  // A generator: yields the tail clusters it needs next, is sent a Map i -> their log-probs, returns the token.
  *factored(head) {
    const c = this.clusters;
    const adj = this.adjustments();
    // the known tokens: part 0 the shortlist, part i tail cluster i once revealed
    const ids = new Map([[0, { lo: 0, n: c.shortlist }]]);
    const proc = new Map([[0, this.steps(ids.get(0), head.subarray(0, c.shortlist), adj)]]);
    const hcol = new Float64Array(c.n);
    const bound = new Float64Array(c.n); // B_i: every processed score of cluster i is <= it
    const adjBounds = []; // f_t(head_i) of the touched tokens of cluster i
    c.bounds.forEach(([lo, hi], k) => {
      hcol[k] = head[c.headColumn(k + 1)];
      const t = adj.touched.filter((id) => id >= lo && id < hi);
      const fb = this.steps(t, t.map(() => hcol[k]), adj);
      adjBounds.push(fb);
      let top = -Infinity;
      for (const v of fb) if (v > top) top = v;
      bound[k] = fb.length && top > hcol[k] ? top : hcol[k];
    });
    // a cluster the constraint closes whole holds no candidate: bound -inf, mass 0, never revealed
    const closed = new Set();
    if (this.allowedNow) {
      c.bounds.forEach(([lo, hi], k) => {
        let open = false;
        for (let v = lo; v < hi && !open; v++) open = !!this.allowedNow[v];
        if (!open) { closed.add(k + 1); bound[k] = -Infinity; }
      });
    }
    const self = this;
    function* reveal(needed) {
      const given = yield needed;
      for (const i of needed) {
        const [lo, hi] = c.bounds[i - 1];
        if (given.get(i)?.length !== hi - lo) {
          throw new RangeError(`tail cluster ${i} has ${hi - lo} tokens, got ${given.get(i)?.length ?? 0} log-probs`);
        }
        ids.set(i, { lo, n: hi - lo });
        proc.set(i, self.steps(ids.get(i), given.get(i), adj));
      }
    }
    const hidden = () => c.bounds.map((_, k) => k + 1).filter((i) => !ids.has(i));
    return this.params.temperature === 0
      ? yield* this.greedy(proc, ids, bound, hidden, reveal)
      : yield* this.sample(proc, ids, bound, hcol, adjBounds, hidden, reveal, closed);
  }

  // The first maximum: a hidden cluster can hold it only if its bound beats the best known score, or equals it
  // with lower ids than the best known token's.
  *greedy(proc, ids, bound, hidden, reveal) {
    const c = this.clusters;
    let best, bestId;
    for (;;) {
      best = -Infinity;
      bestId = -1;
      for (const k of sortedKeys(proc)) {
        const v = proc.get(k);
        let j = 0;
        for (let t = 1; t < v.length; t++) if (v[t] > v[j]) j = t;
        if (v[j] > best) { best = v[j]; bestId = ids.get(k).lo + j; }
      }
      const can = hidden().filter((i) => bound[i - 1] > best ||
        (bound[i - 1] === best && best > -Infinity && c.bounds[i - 1][0] < bestId));
      if (can.length === 0) break;
      yield* reveal([largest(can, bound)]);
    }
    if (bestId < 0) throw new RangeError(NOTHING_LEFT);
    return bestId;
  }

  // Temperature, top-k, top-p, min-p and the draw, by rejection over blocks (shortlist tokens, then clusters in id
  // order), a hidden cluster's block an upper bound of its mass.
  *sample(proc, ids, bound, hcol, adjBounds, hidden, reveal, closed) {
    const p = this.params, c = this.clusters, T = p.temperature;
    const x = new Map(); // processed score / T of the known tokens
    const scaled = () => { for (const [k, v] of proc) if (!x.has(k)) x.set(k, v.map((s) => s / T)); };
    const knownX = () => {
      const parts = sortedKeys(x);
      const out = new Float64Array(parts.reduce((n, k) => n + x.get(k).length, 0));
      parts.reduce((at, k) => (out.set(x.get(k), at), at + x.get(k).length), 0);
      return out;
    };
    const maxOf = (a) => { let m = -Infinity; for (const v of a) if (v > m) m = v; return m; };
    scaled();
    const xb = bound.map((b) => b / T);
    // the shift m: from the head alone, >= every scaled score (so no weight overflows)
    const x0 = x.get(0).length ? maxOf(x.get(0)) : -Infinity, xbMax = maxOf(xb);
    const m = xbMax > x0 ? xbMax : x0;
    if (!(m > -Infinity)) throw new RangeError(NOTHING_LEFT);
    const dead = new Set(closed); // hidden clusters whose every token is filtered out
    let kth = -Infinity;
    if (p.topK !== null && p.topK < this.nToken) {
      // the k-th largest known score is <= the true k-th; a hidden cluster below it holds none of the top k
      for (;;) {
        const kx = knownX().sort();
        kth = kx.length < p.topK ? -Infinity : kx[kx.length - p.topK];
        const can = hidden().filter((i) => xb[i - 1] >= kth && !closed.has(i));
        if (can.length === 0) break;
        yield* reveal([largest(can, xb)]);
        scaled();
      }
      for (const i of hidden()) dead.add(i);
    }
    const weights = (k) => x.get(k).map((v) => Math.exp((v < kth ? -Infinity : v) - m));
    // per hidden cluster: the largest weight one token can have, and the mass bound W_i
    const tb = xb.map((v) => Math.exp(v - m));
    const mass = c.bounds.map(([lo, hi], k) => (1 + MASS_MARGIN) *
      (Math.exp(hcol[k] / T - m) * powerSumBound(hi - lo, T) +
       pairwiseSum(adjBounds[k].map((f) => Math.exp(f / T - m)))));
    for (const i of closed) mass[i - 1] = 0;
    const cut = new Uint8Array(this.nToken); // 1: a token top-p cuts
    if (p.topP < 1) {
      // the known tokens ranked most likely first (ties in id order), each part merged in once as it is revealed
      let wr = new Float64Array(0), wid = new Int32Array(0), ranked, limitHi, live;
      const merged = new Set();
      for (;;) {
        for (const k of sortedKeys(x)) {
          if (merged.has(k)) continue;
          merged.add(k);
          const w = weights(k), { lo } = ids.get(k);
          const local = Uint32Array.from(w.keys()).sort((a, b) => (w[b] - w[a]) || (a - b));
          const n = wr.length + w.length, mw = new Float64Array(n), mid = new Int32Array(n);
          for (let r = 0, a = 0, b = 0; r < n; r++) {
            const fromOld = b >= local.length || (a < wr.length &&
              (wr[a] > w[local[b]] || (wr[a] === w[local[b]] && wid[a] < lo + local[b])));
            if (fromOld) { mw[r] = wr[a]; mid[r] = wid[a++]; } else { mw[r] = w[local[b]]; mid[r] = lo + local[b++]; }
          }
          wr = mw;
          wid = mid;
        }
        live = hidden().filter((i) => !dead.has(i));
        ranked = new Float64Array(wr.length);
        let sum = 0;
        for (let r = 0; r < wr.length; r++) ranked[r] = sum += wr[r];
        const totalLo = ranked[ranked.length - 1];
        let hiddenMass = 0;
        for (const i of live) hiddenMass += mass[i - 1];
        const limitLo = p.topP * totalLo;
        limitHi = p.topP * (totalLo + hiddenMass);
        // every known token sure: kept for sure (the weight ranked before it, hidden clusters' bounds included, is
        // below p L) or cut for sure (the known weight before it is at least p U)
        let sure = true;
        for (let r = 0; r < wr.length && sure; r++) {
          const before = r ? ranked[r - 1] : 0;
          if (before >= limitHi) continue;
          let unknownBefore = 0;
          for (const i of live) unknownBefore += tb[i - 1] >= wr[r] ? mass[i - 1] : 0;
          sure = before + unknownBefore < limitLo;
        }
        // a hidden cluster is cut for sure if the known tokens heavier than any of its tokens weigh at least p U
        const settled = live.filter((i) => {
          let a = 0, b = wr.length; // the known tokens heavier than tb_i: a prefix of the ranking
          while (a < b) { const mid = (a + b) >> 1; if (wr[mid] > tb[i - 1]) a = mid + 1; else b = mid; }
          return (a ? ranked[a - 1] : 0) >= limitHi;
        });
        if (sure && settled.length === live.length) break;
        yield* reveal([largest(live, mass)]);
        scaled();
      }
      for (const i of live) dead.add(i);
      for (let r = 0; r < wr.length; r++) if ((r ? ranked[r - 1] : 0) >= limitHi) cut[wid[r]] = 1;
    }
    let floor = 0;
    if (p.minP > 0) {
      // the cut is min_p times the largest weight: exact once no hidden cluster can beat the known maximum
      let top;
      for (;;) {
        top = maxOf(knownX());
        const can = hidden().filter((i) => !dead.has(i) && xb[i - 1] > top);
        if (can.length === 0) break;
        yield* reveal([largest(can, xb)]);
        scaled();
      }
      floor = p.minP * Math.exp(top - m); // top-k and top-p keep the most likely token
      for (const i of hidden()) if (tb[i - 1] < floor) dead.add(i);
    }
    const final = (k) => {
      const w = weights(k), { lo } = ids.get(k);
      for (let j = 0; j < w.length; j++) if (cut[lo + j] || w[j] < floor) w[j] = 0;
      return w;
    };
    for (;;) {
      const blocks = [];
      for (let k = 0; k <= c.n; k++) {
        blocks.push(proc.has(k) ? final(k) : Float64Array.of(dead.has(k) ? 0 : mass[k - 1]));
      }
      let total = 0, last = -1, flat = 0;
      for (const b of blocks) for (const v of b) { total += v; if (v > 0) last = flat; flat++; }
      if (!(total > 0)) throw new RangeError(NOTHING_LEFT);
      const target = this.random() * total;
      let at = 0, sum = 0;
      for (const b of blocks) { // the first position whose running sum exceeds the target
        let j = 0;
        for (; j < b.length && !((sum += b[j]) > target); j++);
        at += j;
        if (j < b.length) break;
      }
      at = Math.min(at, last); // a rounding past the end: the last block with mass
      let k = 0, start = 0;
      while (at >= start + blocks[k].length) { start += blocks[k].length; k++; }
      if (proc.has(k)) return ids.get(k).lo + at - start;
      // a hidden cluster's block: reveal it, accept with probability S_i / W_i, then draw inside it
      yield* reveal([k]);
      scaled();
      const w = final(k);
      let inner = 0;
      for (const v of w) inner += v;
      if (this.random() * mass[k - 1] < inner) return ids.get(k).lo + draw(w, this.random());
    }
  }
}

// Temperature, then top-k (ties with the k-th stay), top-p (a token stays while the more likely ones, ties in id
// order, weigh less than p of the total), min-p: the unnormalised probabilities of the tokens left.
export function filteredWeights(scores, { temperature, topK = null, topP = 1, minP = 0 }) {
  const n = scores.length;
  const s = scores.map((v) => v / temperature);
  if (topK !== null && topK < n) {
    const kth = Float64Array.from(s).sort()[n - topK];
    for (let i = 0; i < n; i++) if (s[i] < kth) s[i] = -Infinity;
  }
  let max = -Infinity;
  for (let i = 0; i < n; i++) if (s[i] > max) max = s[i];
  const w = s.map((v) => Math.exp(v - max));
  if (topP < 1) {
    const order = Array.from(w.keys()).sort((a, b) => (w[b] - w[a]) || (a - b));
    let total = 0;
    for (const i of order) total += w[i];
    const limit = topP * total;
    let before = 0;
    const cut = [];
    for (const i of order) {
      if (before >= limit) cut.push(i);
      before += w[i];
    }
    for (const i of cut) w[i] = 0;
  }
  if (minP > 0) {
    let top = 0;
    for (let i = 0; i < n; i++) if (w[i] > top) top = w[i];
    for (let i = 0; i < n; i++) if (w[i] < minP * top) w[i] = 0;
  }
  return w;
}

// The first token whose running sum of weights exceeds u times their total.
export function draw(weights, u) {
  const cum = new Float64Array(weights.length);
  let total = 0;
  for (let i = 0; i < weights.length; i++) cum[i] = total += weights[i];
  const x = u * total;
  for (let i = 0; i < cum.length; i++) if (cum[i] > x) return i;
  return weights.length - 1;
}

// Stop strings over a stream of text pieces (txl_deploy/serving/http/completion.py's StopText): push(piece, check)
// -> [text safe to show, whether a stop string was found]; the match itself is never shown, and text that may still
// become one is held back until it cannot (flush() gives it).
export class StopText {
  constructor(stops = []) {
    this.stops = stops.filter((x) => x.length > 0);
    this.held = "";
  }

  push(piece, check = true) {
    const text = this.held + piece;
    const start = this.held.length;
    const hits = check ? this.stops.map((x) => text.indexOf(x, Math.max(0, start - x.length + 1))) : [];
    if (hits.some((i) => i >= 0)) {
      this.held = "";
      return [text.slice(0, Math.min(...hits.filter((i) => i >= 0))), true];
    }
    const longest = Math.max(1, ...this.stops.map((x) => x.length)) - 1;
    let keep = 0;
    for (let k = Math.min(longest, text.length); k > 0; k--) {
      if (this.stops.some((x) => x.startsWith(text.slice(text.length - k)))) { keep = k; break; }
    }
    this.held = text.slice(text.length - keep);
    return [text.slice(0, text.length - keep), false];
  }

  flush() {
    const out = this.held;
    this.held = "";
    return out;
  }
}
