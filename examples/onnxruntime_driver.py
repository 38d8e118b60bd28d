"""A minimal driver for a txl-deploy ONNX file with nothing but numpy and onnxruntime.

Written from the graph contract in docs/graph-contract.md alone, as a driver in another language would be: it reads the
settings from the file's metadata, keeps the memory itself, and threads it from call to call in either layout.

    python examples/onnxruntime_driver.py model.onnx --prompt "And God said" --max-new-tokens 40

It never imports txl_deploy (a test runs it against TxlRuntime).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnxruntime as ort


class Driver:
    """`batch` independent streams through one exported graph; the memory lives in numpy arrays here."""

    def __init__(self, path: str, batch: int = 1, threads: int = 1):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        # No prepacked copies of the weights (a packed MatMul weight is a second copy of it; the tied output weight
        # is also read by the embedding): less RAM, the same decode speed, and the kernels txl-deploy's runtime runs
        opts.add_session_config_entry("session.disable_prepacking", "1")
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map  # ModelProto.metadata_props
        export = json.loads(meta["txl_deploy.export"])
        self.config = json.loads(meta["txl_deploy.config"])
        self.vocab = json.loads(meta["txl_deploy.vocab"]) if "txl_deploy.vocab" in meta else None
        self.mem_len, self.max_segment, self.layout = export["mem_len"], export["max_segment"], export["state"]
        self.n_layer, self.n_head, self.d_head = self.config["n_layer"], self.config["n_head"], self.config["d_head"]
        types = {i.name: i.type for i in self.session.get_inputs()}
        # fp16 files carry a float16 state, the others float32
        self.state_dtype = np.float16 if types["mem_k.0"] == "tensor(float16)" else np.float32
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.batch = batch
        B, H, Dh, M = batch, self.n_head, self.d_head, self.mem_len
        self.mem = {}
        for i in range(self.n_layer):
            self.mem[f"mem_k.{i}"] = np.zeros((B, H, Dh, M), self.state_dtype)
            self.mem[f"mem_v.{i}"] = np.zeros((B, H, M, Dh), self.state_dtype)
        self.mem["mem_count"] = np.zeros(B, np.int64)

    def reset_row(self, row: int):
        """A count of 0 starts the row afresh; the stale ring contents are masked by the graph."""
        self.mem["mem_count"][row] = 0

    def step(self, tokens) -> np.ndarray:
        """tokens [batch, Q] -> log_probs [batch, Q, V] (float32); longer input goes in pieces of max_segment."""
        tokens = np.asarray(tokens, dtype=np.int64)
        pieces = [self._run(tokens[:, lo:lo + self.max_segment])
                  for lo in range(0, tokens.shape[1], self.max_segment)]
        return np.concatenate(pieces, axis=1)

    def _run(self, tokens: np.ndarray) -> np.ndarray:
        B, Q = tokens.shape
        feeds = dict(self.mem)
        feeds["tokens"] = tokens
        feeds["out_positions"] = np.ascontiguousarray(np.broadcast_to(np.arange(Q, dtype=np.int64), (B, Q)))
        outs = dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        if self.layout == "full":
            for i in range(self.n_layer):
                self.mem[f"mem_k.{i}"] = outs[f"next_mem_k.{i}"]
                self.mem[f"mem_v.{i}"] = outs[f"next_mem_v.{i}"]
            self.mem["mem_count"] = outs["next_mem_count"]
        else:
            M, count = self.mem_len, self.mem["mem_count"]
            first = max(0, Q - M)  # of a segment longer than the memory only the last mem_len entries count
            for b in range(B):
                slots = (count[b] + np.arange(first, Q)) % M
                for i in range(self.n_layer):
                    self.mem[f"mem_k.{i}"][b][:, :, slots] = outs[f"new_k.{i}"][b][:, :, first:]
                    self.mem[f"mem_v.{i}"][b][:, slots, :] = outs[f"new_v.{i}"][b][:, first:, :]
            self.mem["mem_count"] = count + Q
        return outs["log_probs"]

    # -- text, for the command line (the contract's "Text"; <unk> and <eos> left out for brevity) -----------------
    KINDS = ("char", "word", "bytes", "text8")

    def encode(self, text: str) -> np.ndarray:
        kind = self.vocab["kind"]
        if kind not in self.KINDS:  # a kind this driver does not know: never read it as another
            raise ValueError(f"vocabulary kind {kind!r} is not one this driver knows")
        index = {s: i for i, s in enumerate(self.vocab["symbols"])}
        if kind == "bytes":  # enwik8: each UTF-8 byte's decimal value; newlines dropped unless "10" is a symbol
            pieces = [str(b) for b in text.encode("utf-8") if b != 10 or "10" in index]
        elif kind == "text8":  # a-z, "_" for the space
            pieces = ["_" if c == " " else c for c in text]
        else:
            pieces = list(text) if kind == "char" else text.split()
        return np.array([index[p] for p in pieces], dtype=np.int64)

    def decode(self, tokens) -> str:
        kind, symbols = self.vocab["kind"], self.vocab["symbols"]
        if kind == "bytes":  # a character may span several tokens: decode the bytes together
            return bytes(int(symbols[t]) for t in tokens).decode("utf-8", "replace")
        if kind == "text8":
            return "".join(" " if symbols[t] == "_" else symbols[t] for t in tokens)
        return "".join(symbols[t] if kind == "char" else " " + symbols[t] for t in tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    driver = Driver(args.model)
    if driver.vocab is None:
        parser.error(f"{args.model} has no vocabulary in its metadata")
    try:
        prompt = driver.encode(args.prompt)
    except KeyError as e:
        parser.error(f"the prompt has a symbol the model's vocabulary lacks: {e}")
    except ValueError as e:
        parser.error(str(e))
    if prompt.size == 0:
        parser.error("the prompt is empty")
    log_probs = driver.step(prompt[None])[0, -1]
    tokens = []
    for _ in range(args.max_new_tokens):  # greedy decoding, one token per call
        tokens.append(int(np.argmax(log_probs)))
        log_probs = driver.step([[tokens[-1]]])[0, -1]
    print(args.prompt + driver.decode(tokens))


if __name__ == "__main__":
    main()
