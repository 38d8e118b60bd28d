// stop_text.js: stop strings over streamed text.

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
