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
// Copy it into your app with the modules it imports (vocab.js, pcg64.js, clusters.js, grammar.js, weights.js,
// sampling.js, factored.js, stop_text.js); they need nothing but onnxruntime-web. It exports all of their API, so
// an app imports from this file alone.

export { Clusters, pairwiseSum } from "./clusters.js";
export { Grammar, GrammarState } from "./grammar.js";
export { Pcg64 } from "./pcg64.js";
export { Sampler, SamplingParams, bannedNgramTokens } from "./sampling.js";
export { StopText } from "./stop_text.js";
export { StreamDecoder, Vocab } from "./vocab.js";
export { draw, filteredWeights } from "./weights.js";

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

  // Forget the memory: zeroed ring buffers and the model's initial count (0: empty; mem_len: a memory of mem_len
  // attended zero vectors, as REMI's starts, whose keys and values are the zeroed buffers).
  reset() {
    const { n_layer, n_head, d_head, mem_len } = this.spec;
    const Buffer = this.spec.float_dtype === "float16" ? Uint16Array : Float32Array; // fp16 kept as raw bits
    this.count = this.spec.initial_mem_count || 0;
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
