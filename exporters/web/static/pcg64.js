// pcg64.js: numpy's default_rng(seed) in JavaScript, so a seeded page draws the uniform numbers Python draws
// (SeedSequence, then PCG64 XSL-RR, random() = (next64 >> 11) / 2^53).

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
