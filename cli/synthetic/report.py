"""Markdown tables and plots of experiment summaries (`experiments.summarize`). matplotlib is imported lazily."""

from __future__ import annotations

from pathlib import Path

TITLES = {
    "e1": "E1: JRT-RNN vs causal Based on set disjointness (V = 68)",
    "e2": "E2: JRT-Prompt (CQC) vs standard prompt (CQ) for causal Based on prefix-query MQAR (V = 132)",
}


def _slice_label(name: str) -> str:
    return f"acc ({name.replace('_', ',')})" if "_" in name else f"acc {name}"


def markdown_table(summary: dict) -> str:
    """One row per arm: accuracy per slice as mean ± std over seeds (each seed listed), state size, speed."""
    arms = summary["arms"]
    slices = list(next(iter(arms.values()))["mean"])
    lines = [f"### {TITLES.get(summary['experiment'], summary['experiment'])}", ""]
    header = ["arm", "steps", "seeds"] + [_slice_label(s) for s in slices] + [
        "final train loss", "state floats (LA + conv)", "params", "ms/step"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for arm, stats in arms.items():
        cells = [arm, str(stats["steps"]), " ".join(str(s) for s in stats["seeds"])]
        for s in slices:
            per_seed = ", ".join(f"{a:.3f}" for a in stats["accuracy"][s])
            cells.append(f"**{stats['mean'][s]:.3f} ± {stats['std'][s]:.3f}** ({per_seed})")
        state = stats["recurrent_state_floats"]
        cells += [
            ", ".join(f"{loss:.3f}" for loss in stats["final_train_loss"]),
            f"{state['linear_attention']} + {state['conv']}",
            str(stats["num_parameters"]),
            f"{stats['ms_per_step']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    stds = {stats.get("embedding_init_std") for stats in arms.values()}
    lines += ["", "Token-embedding init: " + ", ".join(
        "model default N(0, 0.02^2)" if std is None else f"N(0, {std:g}^2)" for std in sorted(stds, key=str)) + "."]
    verdict = summary.get("verdict", {})
    if verdict:
        lines += ["", f"Criterion: {verdict.get('criterion', '')}. "
                      f"**{'Reproduced' if verdict.get('reproduced') else 'Not reproduced'}**."]
        details = {k: v for k, v in verdict.items() if k not in ("criterion", "reproduced")}
        lines.append("Details: " + ", ".join(f"{k} = {_fmt(v, signed=k.startswith('gap'))}"
                                             for k, v in details.items()) + ".")
    if "wall_seconds" in summary:
        machine = summary["machine"]
        lines.append(
            f"Wall time {summary['wall_seconds'] / 60:.1f} min with {summary['jobs']} single-thread processes on "
            f"{machine['cpu_count']} CPU(s) ({machine['processor']}, {machine['platform']}, torch {machine['torch']})."
        )
    return "\n".join(lines) + "\n"


def _fmt(value, signed: bool = False) -> str:
    if isinstance(value, float):
        return f"{value:+.3f}" if signed else f"{value:.3f}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, signed) for v in value) + "]"
    return str(value)


def plot_accuracy(summary: dict, path: str | Path) -> None:
    """Grouped bars: one group per eval slice, one bar per arm (mean over seeds), each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    slices = list(next(iter(arms.values()))["mean"])
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(slices), 3.6))
    for i, (arm, stats) in enumerate(arms.items()):
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(slices))]
        ax.bar(xs, [stats["mean"][s] for s in slices], width, yerr=[stats["std"][s] for s in slices],
               capsize=3, label=arm, alpha=0.8)
        for x, s in zip(xs, slices):
            ax.scatter([x] * len(stats["accuracy"][s]), stats["accuracy"][s], color="black", s=10, zorder=3)
    ax.set_xticks(range(len(slices)), [_slice_label(s).replace("acc ", "") for s in slices])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out accuracy")
    steps = next(iter(arms.values()))["steps"]
    ax.set_title(f"{summary['experiment'].upper()} ({steps} steps; bars: mean ± std, dots: seeds)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
