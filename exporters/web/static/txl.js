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
// (a-z, "_" for the space). Another kind (from a newer txl-deploy) is refused, never read as one of these.
const KINDS = ["word", "char", "bytes", "text8"];
const UNK = "<unk>", EOS = "<eos>";

export class Vocab {
  constructor({ kind, symbols }) {
    if (!KINDS.includes(kind)) {
      throw new Error(`vocabulary kind ${JSON.stringify(kind)} is not one this txl.js knows (${KINDS.join(", ")})`);
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

// One token from log-probs: temperature 0 is greedy (the first maximum, as numpy's argmax); topK keeps the k
// most likely tokens. `random` returns uniform numbers in [0, 1).
export function sample(logProbs, temperature, topK = 0, random = Math.random) {
  let best = 0;
  for (let i = 1; i < logProbs.length; i++) if (logProbs[i] > logProbs[best]) best = i;
  if (temperature === 0) return best;
  let kth = -Infinity;
  if (topK > 0 && topK < logProbs.length) kth = Float32Array.from(logProbs).sort()[logProbs.length - topK];
  const top = logProbs[best] / temperature;
  const weights = new Float64Array(logProbs.length);
  let total = 0;
  for (let i = 0; i < logProbs.length; i++) {
    if (logProbs[i] >= kth) total += weights[i] = Math.exp(logProbs[i] / temperature - top);
  }
  let r = random() * total;
  for (let i = 0; i < weights.length; i++) if (weights[i] > 0 && (r -= weights[i]) < 0) return i;
  return best;
}
