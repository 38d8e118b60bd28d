"""The exported graphs' inputs, outputs and memory pairing, declared once (as optimum's export configs do).

The exporter, the verifier, every runtime and the Triton writer read names, shapes and the pairing (input
`mem_k.i` -> output `new_k.i` or `next_mem_k.i`) from here, so none of them spells the contract again. No torch.
The memory is a ring of `mem_len` slots per layer holding the projected keys (pre-transposed) and values, plus a
per-row `mem_count`; a graph is `incremental` (this segment's entries out) or `full` (the whole next state out),
and `out_positions` picks the positions whose log-probabilities are computed. The contract, slot by slot:
docs/graph-contract.md.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_VERSION = 1
META_PREFIX = "txl_deploy."
STATE_LAYOUTS = ("incremental", "full")

TOKENS = "tokens"
OUT_POSITIONS = "out_positions"
LOG_PROBS = "log_probs"
MEM_COUNT = "mem_count"
NEXT_MEM_COUNT = "next_mem_count"


def mem_k(i: int) -> str:
    return f"mem_k.{i}"


def mem_v(i: int) -> str:
    return f"mem_v.{i}"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple  # ints, or strings naming dynamic axes ("batch", "segment", "positions")
    dtype: str  # numpy dtype name; "float" means the graph's float type (float32 or float16)

    def shape_for(self, batch: int) -> tuple:
        """The concrete shape of a state tensor for `batch` rows (state tensors have only the batch axis dynamic)."""
        return tuple(batch if d == "batch" else d for d in self.shape)


@dataclass(frozen=True)
class GraphSpec:
    n_layer: int
    n_head: int
    d_head: int
    mem_len: int
    n_token: int
    state: str = "incremental"

    def __post_init__(self):
        if self.state not in STATE_LAYOUTS:
            raise ValueError(f"state layout must be one of {STATE_LAYOUTS}, got {self.state!r}")
        if self.mem_len <= 0:
            raise ValueError("exported graphs need mem_len >= 1 (a fixed memory buffer)")

    # shapes of one layer's memory
    def k_shape(self, batch="batch", slots=None):
        return (batch, self.n_head, self.d_head, self.mem_len if slots is None else slots)

    def v_shape(self, batch="batch", slots=None):
        return (batch, self.n_head, self.mem_len if slots is None else slots, self.d_head)

    def state_inputs(self) -> list[TensorSpec]:
        specs = []
        for i in range(self.n_layer):
            specs.append(TensorSpec(mem_k(i), self.k_shape(), "float"))
            specs.append(TensorSpec(mem_v(i), self.v_shape(), "float"))
        specs.append(TensorSpec(MEM_COUNT, ("batch",), "int64"))
        return specs

    def inputs(self) -> list[TensorSpec]:
        return [
            TensorSpec(TOKENS, ("batch", "segment"), "int64"),
            TensorSpec(OUT_POSITIONS, ("batch", "positions"), "int64"),
        ] + self.state_inputs()

    def state_outputs(self) -> list[TensorSpec]:
        specs = []
        for i in range(self.n_layer):
            if self.state == "incremental":
                specs.append(TensorSpec(f"new_k.{i}", self.k_shape(slots="segment"), "float"))
                specs.append(TensorSpec(f"new_v.{i}", self.v_shape(slots="segment"), "float"))
            else:
                specs.append(TensorSpec(f"next_mem_k.{i}", self.k_shape(), "float"))
                specs.append(TensorSpec(f"next_mem_v.{i}", self.v_shape(), "float"))
        if self.state == "full":
            specs.append(TensorSpec(NEXT_MEM_COUNT, ("batch",), "int64"))
        return specs

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(LOG_PROBS, ("batch", "positions", self.n_token), "float")] + self.state_outputs()

    def pairing(self) -> dict[str, str]:
        """state input name -> the output that feeds it (full layout) or carries its new entries (incremental)."""
        out = {}
        for i in range(self.n_layer):
            if self.state == "incremental":
                out[mem_k(i)], out[mem_v(i)] = f"new_k.{i}", f"new_v.{i}"
            else:
                out[mem_k(i)], out[mem_v(i)] = f"next_mem_k.{i}", f"next_mem_v.{i}"
        if self.state == "full":
            out[MEM_COUNT] = NEXT_MEM_COUNT
        return out

    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs()]

    def output_names(self) -> list[str]:
        return [s.name for s in self.outputs()]


def r_table_size(clamp_len: int, mem_len: int, max_segment: int) -> int:
    """Distances the graph can see: up to mem_len + max_segment - 1, or clamp_len when that is smaller."""
    longest = mem_len + max_segment  # distances 0 .. mem_len + max_segment - 1
    return min(clamp_len + 1, longest) if clamp_len > 0 else longest
