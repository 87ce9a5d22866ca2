"""Training-curve PNG from the metrics CSV written by train.py."""
from __future__ import annotations

import csv


def _smooth(values: list[float], window: int = 10) -> list[float]:
    """Trailing moving average (no lag at the start, unlike an EMA)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_curves(csv_path, png_path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    depth = sum(1 for k in rows[0] if k.startswith("mtp") and k.endswith("_loss") and "eval" not in k)
    steps = [int(r["step"]) for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [("main_loss", "main (train)")] + [(f"mtp{k}_loss", f"MTP depth {k} (train)")
                                                for k in range(1, depth + 1)]
    for i, (key, label) in enumerate(series):
        ax_loss.plot(steps, _smooth([float(r[key]) for r in rows]), color=f"C{i}", lw=1, label=label)
    ev = [r for r in rows if r.get("eval_main_loss")]
    ev_steps = [int(r["step"]) for r in ev]
    for i, (key, label) in enumerate(series):
        ax_loss.plot(ev_steps, [float(r["eval_" + key]) for r in ev], "o--", color=f"C{i}", ms=3,
                     label=label.replace("train", "held-out"))
        acc_key = "eval_" + key.replace("_loss", "_acc")
        ax_acc.plot(ev_steps, [float(r[acc_key]) for r in ev], "o-", color=f"C{i}", ms=3,
                    label=label.replace(" (train)", ""))
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_loss.set_title("loss (train smoothed; held-out dashed)")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("top-1 accuracy")
    ax_acc.set_title("held-out top-1 accuracy")
    ax_acc.legend(fontsize=8)
    ax_acc.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
