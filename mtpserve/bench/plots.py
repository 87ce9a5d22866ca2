"""PNG plots of benchmark records (`bench latency --plot-dir`, `bench report`)."""
import os


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_latency(record: dict, plot_dir: str, prefix: str = "bench_") -> list[str]:
    """speedup vs k, acceptance per position, TPOT vs batch size (with and without MTP)."""
    plt = _plt()
    rows = record["results"]["configs"]
    rows = [r for r in rows if r.get("mode") == rows[0].get("mode")]   # two modes: plot the first
    os.makedirs(plot_dir, exist_ok=True)
    tag = " (SYNTHETIC acceptance)" if record.get("measurement_mode", "real") != "real" else ""
    paths = []
    batch_sizes = sorted({r["batch_size"] for r in rows})
    scorers = sorted({r["scorer"] for r in rows if r["scorer"]}, key=lambda x: (x != "mqa", x))   # mqa first
    fig, ax = plt.subplots(figsize=(6, 4))
    for bs in batch_sizes:
        for sc in scorers:
            pts = sorted((r["k"], r.get("tpot_speedup") or 1.0) for r in rows
                         if r["batch_size"] == bs and (r["scorer"] == sc or r["k"] == 0))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {bs}, {sc}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="k (num_speculative_tokens)", ylabel="TPOT speedup vs no MTP", title="Speedup vs k" + tag)
    ax.set_xticks(sorted({r["k"] for r in rows}))
    ax.legend(fontsize=7)
    paths.append(_save(fig, plot_dir, prefix + "speedup_vs_k.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["k"] and r["batch_size"] == batch_sizes[0] and r["scorer"] == scorers[0]:
            pos = r["acceptance_per_position"]
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=f"k={r['k']}")
    ax.set(xlabel="draft position", ylabel="fraction of drafts accepted", ylim=(0, 1.05),
           title=f"Acceptance per position (batch {batch_sizes[0]}, {scorers[0] if scorers else ''})" + tag)
    ax.legend(fontsize=7)
    paths.append(_save(fig, plot_dir, prefix + "acceptance_per_position.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({r["k"] for r in rows}):
        pts = sorted((r["batch_size"], r["tpot_ms"]["mean"]) for r in rows
                     if r["k"] == k and (k == 0 or r["scorer"] == scorers[0]))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="no MTP" if k == 0 else f"MTP k={k} ({scorers[0]})")
    ax.set(xlabel="batch size", ylabel="TPOT (ms)", xscale="log", title="TPOT vs batch size" + tag)
    ax.legend(fontsize=7)
    paths.append(_save(fig, plot_dir, prefix + "tpot_vs_batch.png"))
    return paths


def _save(fig, plot_dir: str, name: str) -> str:
    path = os.path.join(plot_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def plot_serve(by_concurrency: dict, plot_dir: str) -> str:
    """TPOT (median) against concurrency, one line per server configuration."""
    plt = _plt()
    os.makedirs(plot_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec in sorted({s for v in by_concurrency.values() for s in v}):
        pts = sorted((c, v[spec]["tpot_ms"]["median"]) for c, v in by_concurrency.items() if spec in v)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=spec)
    ax.set(xlabel="concurrent clients", ylabel="TPOT median (ms)", xscale="log", title="Serving: TPOT by concurrency")
    ax.legend(fontsize=7)
    return _save(fig, plot_dir, "serve_tpot.png")


def plot_bars(groups: dict, ylabel: str, title: str, plot_dir: str, name: str, log: bool = False) -> str:
    """Grouped bars: groups {group label: {bar label: value}} (the same bar labels in every group)."""
    plt = _plt()
    os.makedirs(plot_dir, exist_ok=True)
    bars = list(dict.fromkeys(b for g in groups.values() for b in g))
    width = 0.8 / max(1, len(bars))
    fig, ax = plt.subplots(figsize=(6, 4))
    for j, b in enumerate(bars):
        ax.bar([i + j * width for i in range(len(groups))], [g.get(b, 0) for g in groups.values()], width,
               label=b, color=f"C{j}")
    ax.set_xticks([i + width * (len(bars) - 1) / 2 for i in range(len(groups))], list(groups))
    ax.set(ylabel=ylabel, title=title, yscale="log" if log else "linear")
    ax.legend(fontsize=7)
    return _save(fig, plot_dir, name)


def plot_lines(lines: dict, xlabel: str, ylabel: str, title: str, plot_dir: str, name: str) -> str:
    """One line per label: lines {label: [(x, y), ...]}."""
    plt = _plt()
    os.makedirs(plot_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in lines.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker=".", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    return _save(fig, plot_dir, name)
