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

// -- sampling: txl_deploy/runtimes/sampling.py, step for step ----------------------------------------------------
// The same parameters, checked the same way (a bad value throws RangeError), the same steps in the same order, in
// float64, with running sums in the same order, and the same uniform numbers: `Pcg64` is numpy's default_rng(seed)
// (SeedSequence, then PCG64 XSL-RR, random() = (next64 >> 11) / 2^53), so a seeded page samples the tokens that
// TxlRuntime.generate and the HTTP server sample from the same log-probs, for a model without an adaptive softmax
// (Python samples an adaptive one with the cluster-factored algorithm of docs/sampling.md, which this file does not
// implement: the same distribution, other draws).

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

// One stream's sampling: choose(logProbs) -> token id. `random` (uniform in [0, 1)) defaults to Pcg64(seed), or
// Math.random without a seed. `vocab`: the model's Vocab, which banUnk needs (to find <unk>).
export class Sampler {
  constructor(params, nToken, context = [], random = null, vocab = null) {
    if (params.banUnk && vocab === null) {
      throw new RangeError("ban_unk needs the model's vocabulary, to know which token is <unk>");
    }
    this.unk = params.banUnk ? vocab.unk : undefined; // undefined: nothing to ban
    for (const [what, ids] of [["logit_bias", [...params.logitBias.keys()]], ["stop_token_ids", params.stopTokenIds]]) {
      const bad = ids.find((id) => id >= nToken);
      if (bad !== undefined) throw new RangeError(`${what} names token id ${bad}, outside the vocabulary [0, ${nToken})`);
    }
    this.params = params;
    this.nToken = nToken;
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
    return s;
  }

  choose(logProbs) {
    const p = this.params;
    const s = this.scores(logProbs);
    let best = 0;
    for (let i = 1; i < s.length; i++) if (s[i] > s[best]) best = i;
    if (!(s[best] > -Infinity)) throw new RangeError("no token is left to choose: the sampling parameters exclude every token");
    const id = p.temperature === 0 ? best : draw(filteredWeights(s, p), this.random());
    this.generated.push(id);
    this.counts[id] += 1;
    return id;
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
