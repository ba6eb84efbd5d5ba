"""A worker's training curve as a PNG (``shardps worker --plot``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardps.worker.runtime import TrainResult


def plot_curve(result: "TrainResult", path: str, title: str) -> None:
    """``shardps worker --plot``: the training loss (and the metric at each evaluation) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    losses = result.losses
    ax.plot(losses, lw=0.6, alpha=0.4, label="loss")
    k = max(1, len(losses) // 50)
    if len(losses) >= k:
        smooth = [sum(losses[i:i + k]) / k for i in range(0, len(losses) - k + 1)]
        ax.plot(range(k - 1, k - 1 + len(smooth)), smooth, lw=1.5, label=f"loss ({k}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if result.curve:
        name = next(iter(result.curve[0][1]))
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in result.curve], [m[name] for _, m in result.curve], "o-", color="C3",
                 label=name)
        ax2.set_ylabel(name)
        ax2.legend(loc="lower right")
    metric = ", ".join(f"{k}={v:.4f}" for k, v in result.metrics.items())
    ax.set_title(f"{title}, rank {result.rank}: {metric}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

