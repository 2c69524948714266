"""The picture of a reward shift: histogram and empirical CDFs (steadyrl.replay, docs/replay.md)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from steadyrl.replay.report import _f


# ---- the picture ------------------------------------------------------------------------------
def _bin_edges(values: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Bins centred on each value when there are few distinct values (rule rewards), else ~auto."""
    u = np.unique(values)
    if len(u) == 1:
        return np.array([u[0] - 0.5, u[0] + 0.5])
    if len(u) <= 30:
        mids = (u[1:] + u[:-1]) / 2
        return np.concatenate([[u[0] - (mids[0] - u[0])], mids, [u[-1] + (u[-1] - mids[-1])]])
    edges = np.histogram_bin_edges(values, bins="auto")
    return edges if len(edges) <= 61 else np.histogram_bin_edges(values, bins=60)


def plot(before: Sequence[float], after: Sequence[float], path: str | os.PathLike[str],
         labels: tuple[str, str] = ("before", "after"), title: str = "") -> None:
    """PNG of the two reward distributions: histogram (share of samples) and empirical CDFs with
    the KS distance (their largest vertical gap) marked."""
    import matplotlib  # lazy: heavy (matplotlib), only the PNG needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: heavy (matplotlib), after choosing the Agg backend

    b, a = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    both = np.concatenate([b, a])
    if len(both):
        edges = _bin_edges(both)
        for v, lab, color in ((b, labels[0], "C0"), (a, labels[1], "C1")):
            if len(v):
                ax1.hist(v, bins=edges, weights=np.full(len(v), 1 / len(v)), alpha=0.45, color=color,
                         edgecolor=color, label=f"{lab} (n={len(v)})")
                xs = np.sort(v)
                ax2.step(np.concatenate([[xs[0]], xs]), np.concatenate([[0], np.arange(1, len(xs) + 1) / len(xs)]),
                         where="post", color=color, label=lab)
        if len(b) and len(a):
            grid = np.unique(both)
            fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
            fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
            i = int(np.argmax(np.abs(fb - fa)))
            ax2.vlines(grid[i], min(fb[i], fa[i]), max(fb[i], fa[i]), colors="k", linestyles="--",
                       label=f"KS D = {abs(fb[i] - fa[i]):.3f}")
    ax1.set_xlabel("reward")
    ax1.set_ylabel("share of samples")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("reward")
    ax2.set_ylabel("cumulative share")
    ax2.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_report(rep: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """`plot` for a `build_report` result, titled with the window and the KS figures."""
    sh = rep["shift"]
    ks = ("" if sh["ks_statistic"] is None else
          f"  KS {sh['ks_statistic']:.3f}, p {sh['ks_pvalue']:.2g}, mean {_f(sh['delta_mean'], '+.3f')}")
    plot(rep["_before"], rep["_after"], path, tuple(sh["labels"]),
         f"{rep['topic']} {rep['from']} .. {rep['to']}{ks}")
