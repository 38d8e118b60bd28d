// vocab.js: text to token ids and back, as txl_deploy.vocab does (Vocab, and StreamDecoder for a stream of ids).

// The model's vocabulary (vocab.json), as txl_deploy.vocab.Vocab reads and writes text. Kinds: "word" (words split
// on whitespace, <eos> at line ends), "char" (one symbol per character), "bytes" (the paper's enwik8: each symbol
// a byte's decimal value; text is UTF-8 and newlines are dropped, as its preprocessing dropped them), "text8"
// (a-z, "_" for the space) and "events" (music events kept whole, spaces included: text is one event a line).
// Another kind (from a newer txl-deploy) is refused, never read as one of these. A word vocabulary read with the Moses tokenizer (tokenizer "wikitext" or "lm1b": WikiText-103's and One Billion Word's
// models) is refused too: the page has no Moses, and splitting on whitespace would give the model other words.
const KINDS = ["word", "char", "bytes", "text8", "events"];
const UNK = "<unk>", EOS = "<eos>";

export class Vocab {
  constructor({ kind, symbols, tokenizer = null, representation = null }) {
    if (!KINDS.includes(kind)) {
      throw new Error(`vocabulary kind ${JSON.stringify(kind)} is not one this txl.js knows (${KINDS.join(", ")})`);
    }
    if (kind === "word" && tokenizer !== null && tokenizer !== "whitespace") {
      throw new Error(`this model reads and writes text with the ${tokenizer} tokenizer (Moses), which the page ` +
        "does not have; run it with txl-deploy generate or serve");
    }
    this.kind = kind;
    this.symbols = symbols;
    this.representation = representation; // an events vocabulary's music representation ("remi", "remi-xl"), or null
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
    if (this.kind === "events") return this.encodeEvents(text.split("\n").map((l) => l.trim()).filter(Boolean));
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

  // Event symbols, each whole (REMI's hold spaces: "Note On_60"), -> ids.
  encodeEvents(events) {
    const problem = (e, n) => `event ${n + 1} (${JSON.stringify(e.slice(0, 80))}) is not in the vocabulary`;
    return events.map((e, n) => this.lookup(e, () => problem(e, n)));
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
    } else if (vocab.kind === "events") { // one event a line; a line the text so far left open is ended first
      text = (!this.last || this.last === "\n" ? "" : "\n") + symbol + "\n";
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
