"""Markdown tables and plots of experiment summaries (`experiments.summarize`). matplotlib is imported lazily."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TITLES = {
    "e1": "E1: JRT-RNN vs causal Based on set disjointness (V = 68)",
    "e1-small": "E1 at half the state (hidden 32, 1 head): JRT-RNN vs causal Based on set disjointness (V = 68)",
    "e2": "E2: JRT-Prompt (CQC) vs standard prompt (CQ) for causal Based on prefix-query MQAR (V = 132)",
}


def _slice_label(name: str) -> str:
    return f"acc ({name.replace('_', ',')})" if "_" in name else f"acc {name}"


def _mean_std(mean: float, std: float, values: list[float]) -> str:
    return f"**{mean:.3f} ± {std:.3f}** ({', '.join(f'{v:.3f}' for v in values)})"


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
        cells += [_mean_std(stats["mean"][s], stats["std"][s], stats["accuracy"][s]) for s in slices]
        state = stats["recurrent_state_floats"]
        cells += [", ".join(f"{loss:.3f}" for loss in stats["final_train_loss"]),
                  f"{state['linear_attention']} + {state['conv']}", str(stats["num_parameters"]),
                  f"{stats['ms_per_step']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if all("curve" in stats for stats in arms.values()):
        steps = list(next(iter(arms.values()))["curve"])
        lines += ["", "Held-out accuracy during training (mean over seeds; slices in the order above):", "",
                  "| arm | " + " | ".join(f"step {step}" for step in steps) + " |",
                  "|" + " --- |" * (len(steps) + 1)]
        for arm, stats in arms.items():
            cells = [" / ".join(f"{stats['curve'][step][s]:.3f}" for s in slices) for step in steps]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
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
    return "[" + ", ".join(_fmt(v, signed) for v in value) + "]" if isinstance(value, list) else str(value)


def plot_accuracy(summary: dict, path: str | Path) -> None:
    """Left: grouped bars, one group per eval slice, one bar per arm (mean ± std over seeds, each seed a dot).
    Right (when the summary has learning curves): mean accuracy on the last slice against training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    slices = list(next(iter(arms.values()))["mean"])
    width = 0.8 / len(arms)
    with_curves = all("curve" in stats for stats in arms.values())
    fig, axes = plt.subplots(1, 2 if with_curves else 1, figsize=(1.6 + 1.9 * len(slices) + 3.6 * with_curves, 3.6),
                             squeeze=False)
    ax = axes[0, 0]
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
    std = next(iter(arms.values())).get("embedding_init_std")
    init = "emb. init N(0, 0.02²)" if std is None else f"emb. init N(0, {std:g}²)"
    ax.set_title(f"{summary['experiment'].upper()}: {steps} steps, {init}\nbars: mean ± std over seeds, dots: seeds",
                 fontsize=9)
    if with_curves:
        curve_ax, last = axes[0, 1], slices[-1]
        for arm, stats in arms.items():
            steps = [int(step) for step in stats["curve"]]
            curve_ax.plot(steps, [stats["curve"][str(step)][last] for step in steps], marker="o", label=arm)
        curve_ax.set_ylim(0, 1.05)
        curve_ax.set_xlabel("training step")
        curve_ax.set_title(f"{_slice_label(last)} during training (mean over seeds)", fontsize=9)
        curve_ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(arms), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def extra_eval_table(results: dict) -> str:
    """Markdown of `experiments.evaluate_saved_models`: one row per arm, mean ± std (per seed) per slice."""
    slices = list(next(iter(results.values())))
    lines = ["| arm | " + " | ".join(_slice_label(s) for s in slices) + " |", "|" + " --- |" * (len(slices) + 1)]
    for arm, by_slice in results.items():
        cells = [_mean_std(float(np.mean(by_slice[s])), float(np.std(by_slice[s])), by_slice[s]) for s in slices]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
