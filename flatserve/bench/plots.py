"""PNG plots of benchmark runs: throughput and TTFT vs concurrency (a line per run), RSS over time."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_runs(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label, fname, scale in (("output_throughput", "output tokens/s", "throughput.png", 1.0),
                                     ("ttft_p50", "TTFT p50 (ms)", "ttft.png", 1e3)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            lv = r["levels"]
            ys = [(s[key] or 0) * scale for s in lv]
            ax.plot([s["concurrency"] for s in lv], ys, marker="o", label=r.get("label") or r["model"])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(out / fname)
    if any(s.get("rss") for r in runs for s in r["levels"]):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            t0 = 0.0
            for s in r["levels"]:
                if s.get("rss"):
                    ax.plot([t0 + t for t, _ in s["rss"]], [b / 2**30 for _, b in s["rss"]],
                            label=f"{r.get('label') or r['model']} c={s['concurrency']}")
                    t0 += s["rss"][-1][0]
        ax.set_xlabel("seconds")
        ax.set_ylabel("server RSS (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "rss.png", dpi=110)
        plt.close(fig)
        paths.append(out / "rss.png")
    return paths
