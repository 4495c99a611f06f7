"""The soak's timeline: faults as marked lines and spans, every turn's TTFT, the server's RSS beside them."""

from __future__ import annotations

from pathlib import Path

from harness import plots  # sets the Agg backend
import matplotlib.pyplot as plt  # noqa: E402

LINES = {"sigkill": ("tab:red", "-"), "sigterm": ("tab:orange", "-"), "corrupt": ("black", ":"),
         "hangup": ("tab:purple", "--"), "flood": ("tab:brown", "--")}
SPANS = {"disk_full": "tab:red", "read_only": "tab:blue"}


def timeline_plot(requests: list[dict], events: list[dict], rss: list, path: Path, title: str) -> Path:
    """TTFT of every answered agent turn over time (streamed: to the first token; not streamed: the whole
    reply), fault events as vertical lines (crashes, corruptions, hang-ups, floods) and spans (disk full,
    read-only), and the server's RSS on a second axis."""
    fig, ax = plt.subplots(figsize=(14, 5.5))
    for stream, marker, label in ((True, ".", "TTFT, streamed"), (False, "x", "latency, not streamed")):
        pts = [(r["t1"], r["ttft_s"]) for r in requests
               if r.get("kind") == "turn" and r["outcome"] == "ok" and r.get("stream") == stream]
        if pts:
            ax.scatter(*zip(*pts), s=8, marker=marker, alpha=0.6, label=label)
    seen = set()
    for e in events:
        kind = e["kind"]
        if kind in LINES:
            color, style = LINES[kind]
            ax.axvline(e["t"], color=color, linestyle=style, linewidth=0.9, alpha=0.8,
                       label=None if kind in seen else kind)
            seen.add(kind)
        for span, color in SPANS.items():
            if kind == f"{span}_start":
                end = next((x["t"] for x in events if x["kind"] == f"{span}_end" and x["t"] >= e["t"]), e["t"])
                ax.axvspan(e["t"], end, color=color, alpha=0.15, label=None if span in seen else span)
                seen.add(span)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.set_title(title)
    if rss:
        ax2 = ax.twinx()
        ax2.plot([r[0] for r in rss], [r[3] / 2**20 for r in rss], color="tab:green", linewidth=1, label="server RSS")
        ax2.set_ylabel("server RSS (MiB)", color="tab:green")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
    else:
        h2, l2 = [], []
    h1, l1 = ax.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8, ncol=3)
    return plots.save(fig, path, dpi=110)
