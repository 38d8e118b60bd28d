"""The benchmark's outputs: a table for people, JSON for machines (its fields: docs/benchmarks.md, "The JSON
report"), an optional plot."""

from __future__ import annotations

import json

from txl_deploy.errors import InputError
from txl_deploy.files import atomic_path


def _mb(n):
    return f"{n / 2**20:,.0f} MB"


def _x(v):
    return "-" if v is None else f"{v:.1f}x"


SIDE_ORDER = ("candidate", "compare", "baseline", "eager_as_written")


def table(report: dict) -> str:
    """One row per side; the speedup columns are against the eager baseline of the same (mem_len, batch)."""
    head = ("mem_len", "batch", "backend", "decode p50 ms", "p90", "p99", "tok/s", "prefill ms", "prefill tok/s",
            "peak mem", "decode speedup", "prefill speedup", "floor gap")
    rows = [head]
    for res in report["results"]:
        base = res["sides"].get("baseline")
        for label in sorted(res["sides"], key=lambda k: SIDE_ORDER.index(k) if k in SIDE_ORDER else len(SIDE_ORDER)):
            s = res["sides"][label]
            d = s["decode_ms"]
            floor = res.get("floor") if label == "candidate" else None
            dec_x = _x(base["decode_ms"]["p50"] / d["p50"]) if base and d else ""
            pre_x = _x(base["prefill_ms"] / s["prefill_ms"]) if base else ""
            rows.append((
                str(res["mem_len"]), str(res["batch"]), s["backend"],
                *((f"{d['p50']:.2f}", f"{d['p90']:.2f}", f"{d['p99']:.2f}", f"{s['decode_tokens_per_s']:.1f}")
                  if d else ("-",) * 4),
                f"{s['prefill_ms']:.1f}", f"{s['prefill_tokens_per_s']:.0f}", _mb(s["peak_memory_bytes"]),
                dec_x, pre_x, f"{floor['gap']:.2f}x" if floor else "",
            ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = []
    for res in report["results"]:
        where = f"mem_len {res['mem_len']} batch {res['batch']}"
        p = res.get("parity")
        if p:
            notes.append(f"{where}: log-probs max abs diff {p['max_abs_diff']:.2e} over {p['positions']} positions, "
                         f"top-1 agreement {p['top1_agreement']:.4f} against eager; prefill speedup "
                         f"{_x(res['speedup']['prefill'])}")
            if res["speedup"].get("prefill_vs_as_written") is not None:
                notes[-1] += f" ({_x(res['speedup']['prefill_vs_as_written'])} against eager as written)"
        if res.get("speedup_vs_compare"):
            sc, cp = res["speedup_vs_compare"], res["compare_parity"]
            notes.append(f"{where}: against {res['sides']['compare']['backend']}: decode {sc['decode_p50']:.2f}x, "
                         f"prefill {sc['prefill']:.2f}x; log-probs max abs diff {cp['max_abs_diff']:.2e}, top-1 "
                         f"agreement {cp['top1_agreement']:.4f}")
    return "\n".join(lines + [""] + notes)


def write_json(report: dict, path, force: bool):
    with atomic_path(path, force=force) as tmp:
        tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def pyplot():
    """matplotlib's pyplot drawing to files, or a one-line error where the bench extra is not installed."""
    try:
        import matplotlib  # optional (the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional (the bench extra)
    except ImportError:
        raise InputError("a plot needs matplotlib (pip install matplotlib)") from None
    return plt


def save_figure(fig, path, force: bool):
    """The figure written atomically, in the format its suffix names (png by default), then closed."""
    with atomic_path(path, force=force) as tmp:
        fig.savefig(tmp, dpi=110, format=str(path).rsplit(".", 1)[-1] if "." in str(path) else "png")
    pyplot().close(fig)


def plot(report: dict, path, force: bool):
    """Decode latency (p50) against memory length, one line per backend and batch size; and against batch size."""
    plt = pyplot()

    series = {}
    for res in report["results"]:
        for s in res["sides"].values():
            if s["decode_ms"] is None:  # prefill-only side
                continue
            series.setdefault(s["backend"], []).append((res["mem_len"], res["batch"], s["decode_ms"]["p50"]))
    fig, (ax_m, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for backend, points in series.items():
        for batch in sorted({b for _, b, _ in points}):
            xs = sorted((m, t) for m, b, t in points if b == batch)
            ax_m.plot([m for m, _ in xs], [t for _, t in xs], marker="o", label=f"{backend}, batch {batch}")
        for mem_len in sorted({m for m, _, _ in points}):
            xs = sorted((b, t) for m, b, t in points if m == mem_len)
            ax_b.plot([b for b, _ in xs], [t for _, t in xs], marker="o", label=f"{backend}, mem_len {mem_len}")
    ax_m.set(xlabel="memory length", ylabel="decode latency p50 (ms / step)", yscale="log",
             title=f"{report['model']}: latency vs memory")
    ax_b.set(xlabel="batch size", ylabel="decode latency p50 (ms / step)", yscale="log", title="latency vs batch")
    for ax in (ax_m, ax_b):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, force)
