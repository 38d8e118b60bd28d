// weights.js: a full row's weights after temperature, top-k, top-p and min-p, and the draw from them.

export const NOTHING_LEFT = "no token is left to choose: the sampling parameters exclude every token";

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
