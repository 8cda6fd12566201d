"""PNG plots (matplotlib is the optional ``plot`` extra): latency
distributions per implementation and time versus payload size."""
from __future__ import annotations

import os

from fastmq.bench.config import KiB, fmt_size
from fastmq.bench.report import ORDER


def available() -> tuple[bool, str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False, ("matplotlib is not installed: no plots (pip install "
                       "'vllm-fastmq[plot]' or matplotlib)")
    return True, ""


def _by(records, scenario):
    order = {n: i for i, n in enumerate(ORDER[scenario])}
    rs = [r for r in records if r["scenario"] == scenario and r["impl"] != "floor-memcpy"]
    impls = sorted({r["impl"] for r in rs}, key=lambda i: (order.get(i, 99), i))
    ns = sorted({r["n_readers"] for r in rs})
    return rs, impls, ns


def _vs_size(plt, rs, impls, ns, unit: int, log: bool, xlabel: str, ylabel: str,
             title: str):
    """p50 against size, one line per implementation, one panel per N."""
    fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for impl in impls:
            pts = sorted((r["size_bytes"] / unit, r["p50"]) for r in rs
                         if r["impl"] == impl and r["n_readers"] == n)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, N={n}")
        ax.grid(True, which="both" if log else "major", alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _cdf(ax, samples_ns, label, scale):
    v = sorted(x / scale for x in samples_ns)
    if not v:
        return
    y = [(i + 1) / len(v) for i in range(len(v))]
    ax.step(v, y, where="post", label=label)


def write(records: list[dict], out_dir: str) -> list[str]:
    """Write every plot the records allow into ``out_dir``; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths: list[str] = []

    def save(fig, name):
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    # step: latency distribution per implementation (the size nearest 1 KiB)
    rs, impls, ns = _by(records, "step")
    if rs:
        sizes = sorted({r["size_bytes"] for r in rs})
        size = min(sizes, key=lambda s: abs(s - KiB))
        fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 4), squeeze=False)
        for ax, n in zip(axes[0], ns):
            for impl in impls:
                r = next((r for r in rs if r["impl"] == impl and r["n_readers"] == n
                          and r["size_bytes"] == size), None)
                if r and r.get("samples_ns"):
                    _cdf(ax, r["samples_ns"], impl, 1e3)
            ax.set_xscale("log")
            ax.set_xlabel("round trip (us, log)")
            ax.set_ylabel("fraction of steps")
            ax.set_title(f"step {fmt_size(size)}, N={n}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, "step_latency.png")

        fig = _vs_size(plt, rs, impls, ns, 1, True, "payload (bytes)",
                       "p50 round trip (us)", "step: time vs payload")
        save(fig, "step_vs_size.png")

    rs, impls, ns = _by(records, "tensor")
    if rs:
        fig = _vs_size(plt, rs, impls, ns, 1 << 20, False, "tensor (MiB)",
                       "p50 per message (ms)", "tensor: time vs size")
        save(fig, "tensor_vs_size.png")

    rs, impls, ns = _by(records, "wake")
    if rs:
        fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 4), squeeze=False)
        for ax, n in zip(axes[0], ns):
            for impl in impls:
                r = next((r for r in rs if r["impl"] == impl and r["n_readers"] == n), None)
                if r and r.get("samples_ns"):
                    _cdf(ax, r["samples_ns"], impl, 1e3)
            ax.set_xscale("log")
            ax.set_xlabel("one-way latency from idle (us, log)")
            ax.set_ylabel("fraction of messages")
            ax.set_title(f"wake, N={n}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, "wake_latency.png")

    rs, impls, ns = _by(records, "throughput")
    if rs:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for j, n in enumerate(ns):
                r = next((r for r in rs if r["impl"] == impl and r["n_readers"] == n), None)
                if r:
                    xs.append(j + i * width)
                    ys.append(r["rate"])
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ns))])
        ax.set_xticklabels([f"N={n}" for n in ns])
        ax.set_ylabel("messages / s")
        ax.set_yscale("log")
        ax.set_title("throughput (small messages, pipelined)")
        ax.legend(fontsize=8)
        save(fig, "throughput.png")
    return paths
