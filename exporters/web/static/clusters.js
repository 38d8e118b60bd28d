// clusters.js: the adaptive softmax's layout (txl_deploy/contract/clusters.py) and the head of a full row, summed
// as numpy sums it.

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
