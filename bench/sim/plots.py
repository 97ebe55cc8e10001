"""PNG figures of simulated runs (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from bench.sim.simulator import COMPLETED, SimResult


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # an optional package: the server never plots
        raise ImportError("the figures need matplotlib: pip install -e '.[bench]'", name=exc.name) from exc

    matplotlib.use("Agg")  # no display on benchmark machines
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(results: Mapping[str, SimResult], path: Path) -> None:
    """TTFT and TBT CDFs of completed requests, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        done = r.status == COMPLETED
        for ax, values in ((axes[0], r.ttft_s[done]), (axes[1], r.tbt_s[done])):
            v = np.sort(values[~np.isnan(values)])
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=name)
    slo = next(iter(results.values())).config
    axes[0].axvline(slo.ttft_slo_s, color="grey", ls="--", lw=0.8)
    axes[1].axvline(slo.tbt_slo_s, color="grey", ls="--", lw=0.8)
    axes[0].set(xscale="log", xlabel="TTFT (s)", ylabel="CDF", title="Time to first token")
    axes[1].set(xlabel="TBT, mean of longest 10% gaps (s)", title="Time between tokens")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loads(results: Mapping[str, SimResult], path: Path) -> None:
    """Prefill and decode pool load over time, one panel per run (arXiv Fig. 9/10 style); where
    roles moved, the number of prefill instances serving on a second axis."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], results.items()):
        ax.plot(r.sample_t, r.prefill_load, label="prefill load (queue / TTFT SLO)", lw=0.9)
        ax.plot(r.sample_t, r.decode_load, label="decode load (step time / TBT SLO)", lw=0.9)
        ax.axhline(1.0, color="grey", ls="--", lw=0.8)
        switches = len(r.switches)
        ax.set(ylabel="load", title=f"{name} ({switches} switch{'es' if switches > 1 else ''})" if switches else name)
        if switches:
            count = ax.twinx()
            count.step(r.sample_t, r.prefill_instances, where="post", color="black", lw=0.8)
            count.set(ylabel="prefill instances (black)", ylim=(0, r.prefill_instances[0] + r.decode_instances[0]))
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_switch_cost(costs: Sequence[float], curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
                     fixed: tuple[int, float], path: Path) -> None:
    """Rejections and SLO attainment of elastic roles against the cost of a switch, one line per
    ``curves`` entry (name: rejected, SLO met at each cost), beside the fixed roles' (``fixed``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (ax, label) in enumerate(((axes[0], "rejected requests"), (axes[1], "SLO attainment"))):
        for name, values in curves.items():
            ax.plot(costs, values[i], marker="o", label=f"elastic roles, {name}")
        ax.axhline(fixed[i], color="grey", ls="--", lw=0.8, label="fixed roles (late binding)")
        ax.set(xlabel="switch cost (s)", ylabel=label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(labels: Sequence[str], ours: Sequence[float], paper: Sequence[float], ylabel: str, path: Path) -> None:
    """Our value next to the paper's for each label."""
    plt = _pyplot()
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x - 0.2, ours, 0.4, label="simulated")
    ax.bar(x + 0.2, paper, 0.4, label="paper")
    ax.set_xticks(x, labels)
    ax.set(ylabel=ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hit_curves(capacities: Sequence[float], curves: Mapping[str, Sequence[float]], path: Path) -> None:
    """Hit rate against cache capacity in tokens, one line per trace (FAST'25 Fig. 9 style)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rates in curves.items():
        ax.plot(capacities, rates, marker="o", label=name)
    ax.axvline(3e6, color="grey", ls="--", lw=0.8)
    ax.set(xscale="log", xlabel="cache capacity (tokens)", ylabel="prefix hit rate (token-weighted)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
