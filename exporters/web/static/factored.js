// factored.js: the cluster-factored decision of an adaptive softmax (runtimes/sampling/factored.py, docs/sampling.md),
// for a Sampler: decided on the head and only the tail clusters it needs, the tokens the full row would give.

import { pairwiseSum } from "./clusters.js";
import { draw, NOTHING_LEFT } from "./weights.js";

// Relative slack on a hidden cluster's mass bound (runtimes/sampling/bounds.py's MASS_MARGIN).
const MASS_MARGIN = 1e-4;

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

// A generator: yields the tail clusters it needs next, is sent a Map i -> their log-probs, returns the token.
export function* factoredDecision(sampler, head) {
  const c = sampler.clusters;
  const adj = sampler.adjustments();
  // the known tokens: part 0 the shortlist, part i tail cluster i once revealed
  const ids = new Map([[0, { lo: 0, n: c.shortlist }]]);
  const proc = new Map([[0, sampler.steps(ids.get(0), head.subarray(0, c.shortlist), adj)]]);
  const hcol = new Float64Array(c.n);
  const bound = new Float64Array(c.n); // B_i: every processed score of cluster i is <= it
  const adjBounds = []; // f_t(head_i) of the touched tokens of cluster i
  c.bounds.forEach(([lo, hi], k) => {
    hcol[k] = head[c.headColumn(k + 1)];
    const t = adj.touched.filter((id) => id >= lo && id < hi);
    const fb = sampler.steps(t, t.map(() => hcol[k]), adj);
    adjBounds.push(fb);
    let top = -Infinity;
    for (const v of fb) if (v > top) top = v;
    bound[k] = fb.length && top > hcol[k] ? top : hcol[k];
  });
  // a cluster the constraint closes whole holds no candidate: bound -inf, mass 0, never revealed
  const closed = new Set();
  if (sampler.allowedNow) {
    c.bounds.forEach(([lo, hi], k) => {
      let open = false;
      for (let v = lo; v < hi && !open; v++) open = !!sampler.allowedNow[v];
      if (!open) { closed.add(k + 1); bound[k] = -Infinity; }
    });
  }
  function* reveal(needed) {
    const given = yield needed;
    for (const i of needed) {
      const [lo, hi] = c.bounds[i - 1];
      if (given.get(i)?.length !== hi - lo) {
        throw new RangeError(`tail cluster ${i} has ${hi - lo} tokens, got ${given.get(i)?.length ?? 0} log-probs`);
      }
      ids.set(i, { lo, n: hi - lo });
      proc.set(i, sampler.steps(ids.get(i), given.get(i), adj));
    }
  }
  const hidden = () => c.bounds.map((_, k) => k + 1).filter((i) => !ids.has(i));
  return sampler.params.temperature === 0
    ? yield* greedy(sampler, proc, ids, bound, hidden, reveal)
    : yield* sample(sampler, proc, ids, bound, hcol, adjBounds, hidden, reveal, closed);
}

// The first maximum: a hidden cluster can hold it only if its bound beats the best known score, or equals it
// with lower ids than the best known token's.
function* greedy(sampler, proc, ids, bound, hidden, reveal) {
  const c = sampler.clusters;
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
function* sample(sampler, proc, ids, bound, hcol, adjBounds, hidden, reveal, closed) {
  const p = sampler.params, c = sampler.clusters, T = p.temperature;
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
  if (p.topK !== null && p.topK < sampler.nToken) {
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
  const cut = new Uint8Array(sampler.nToken); // 1: a token top-p cuts
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
    const target = sampler.random() * total;
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
    if (sampler.random() * mass[k - 1] < inner) return ids.get(k).lo + draw(w, sampler.random());
  }
}
