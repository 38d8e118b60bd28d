// grammar.js: a music model's grammar, the mask a Sampler applies so that every sample is valid music.

// Valid music by construction (txl_deploy/music/grammar.py): the grammar model.json carries (`grammar`: its event
// names, which follow which, each token's event and bar position), compiled here to one mask per (last event name,
// position in the bar), as Python compiles it. Grammar.of(spec) is null for a model without one.
export class Grammar {
  constructor({ name, names, follows, kind, position, position_kind, bar, repeat_position, n_positions }) {
    const V = kind.length, P = n_positions + 1;
    Object.assign(this, { name, names, kind, position, positionKind: position_kind, bar, P });
    this.masks = [];
    for (let n = 0; n < names.length; n++) {
      for (let p = 0; p < P; p++) {
        const mask = new Uint8Array(V);
        for (const f of follows[n]) {
          for (let v = 0; v < V; v++) {
            if (kind[v] !== f) continue;
            if (f !== position_kind || (repeat_position ? position[v] >= Math.max(p, 1) : position[v] > p)) {
              mask[v] = 1;
            }
          }
        }
        this.masks.push(mask);
      }
    }
  }

  static of(spec) {
    return spec.grammar ? new Grammar(spec.grammar) : null;
  }

  // A stream's state after `context` (token ids): the constraint a Sampler applies.
  start(context = []) {
    const state = new GrammarState(this);
    for (const t of context) state.advance(t);
    return state;
  }
}

export class GrammarState {
  constructor(grammar) {
    this.grammar = grammar;
    this.last = 0;
    this.at = 0;
  }

  allowed() {
    return this.grammar.masks[this.last * this.grammar.P + this.at];
  }

  advance(token) {
    const g = this.grammar, k = g.kind[token];
    if (k === undefined || k < 0) return; // not an event (a prompt's special symbol): the state stays
    this.at = k === g.positionKind ? g.position[token] : k === g.bar ? 0 : this.at;
    this.last = k;
  }
}
