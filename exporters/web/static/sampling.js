// sampling.js: the sampler every txl-deploy path shares, in JavaScript.
//
// The same parameters, checked the same way (a bad value throws RangeError), the same steps in the same order, in
// float64, with sums in the same order, and the same uniform numbers (`Pcg64` is numpy's default_rng(seed)), so a
// seeded page samples the tokens that TxlRuntime.generate and the HTTP server sample from the same log-probs. A
// model with an adaptive softmax (its `Clusters`, from model.json's clusters) is sampled as Python samples it, by
// the cluster-factored decision of docs/sampling.md (factored.js): decided on the head (the shortlist's log-probs
// and each tail cluster's log-sum-exp, computed from the full row as Clusters.head_from_full computes it, numpy's
// pairwise sum included) and the tail clusters it asks for, consuming the generator as Python does (one uniform per
// block draw, two more when a hidden cluster's block is hit). Math.exp and Math.log may differ from numpy's in the
// last bit, so a decision that falls within that rounding of a boundary can go the other way; nothing else differs.

import { factoredDecision } from "./factored.js";
import { Pcg64 } from "./pcg64.js";
import { draw, filteredWeights, NOTHING_LEFT } from "./weights.js";

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

  // The cluster-factored decision on a head (factored.js): a generator that yields the tail clusters it needs next,
  // is sent a Map i -> their log-probs, and returns the token.
  factored(head) {
    return factoredDecision(this, head);
  }
}
