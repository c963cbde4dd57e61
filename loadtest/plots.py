"""The sweep's figures: the throughput / per-user-speed Pareto frontier (the paper's Figure 7)
and the mean verification length per request against concurrency (Figure 8)."""

from __future__ import annotations

from pathlib import Path

from loadtest.results import LevelResult


def _by_policy(results: list[LevelResult]) -> dict[str, list[LevelResult]]:
    out: dict[str, list[LevelResult]] = {}
    for r in results:
        out.setdefault(r.policy, []).append(r)
    return {p: sorted(rs, key=lambda r: r.users) for p, rs in out.items()}


def plot_frontier(results: list[LevelResult], path: Path, title: str = "") -> None:
    """x: per-user tokens/s, y: aggregate tokens/s; one curve per policy, points = users."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for policy, levels in _by_policy(results).items():
        xs = [r.per_user_tokens_per_s for r in levels]
        ys = [r.aggregate_tokens_per_s for r in levels]
        ax.plot(xs, ys, marker="o", label=policy)
        for r, x, y in zip(levels, xs, ys):
            ax.annotate(f"{r.users}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xlabel("per-user output speed (tokens/s after the first token)")
    ax.set_ylabel("aggregate throughput (tokens/s)")
    ax.set_title(title or "throughput vs per-user speed (labels: concurrent users)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_verification_length(results: list[LevelResult], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, levels in _by_policy(results).items():
        ax.plot([r.users for r in levels], [r.mean_verification_length for r in levels],
                marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("mean drafts verified per request per round")
    ax.set_title(title or "mean verification length vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
