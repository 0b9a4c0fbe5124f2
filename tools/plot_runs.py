"""Plot one or more runs from their metrics.jsonl (and eval.jsonl): reward, KL and held-out accuracy against steps.

    python tools/plot_runs.py runs/async_grpo_gsm8k__1__1764480000 runs/sync_grpo_gsm8k__1__1764480300

Each argument is a run folder (runs/{run_name}, as printed at the end of a run); each run is one line per panel, so an
async run and its sync twin compare directly. Panels: the step's reward (`objective/rlhf_reward` where there is a KL
penalty, else `objective/scores` or GRPO's `objective/accuracy`), the KL to the reference when the run logs one, and
the greedy held-out accuracy of each evaluated policy version when the run evaluated (GRPO runs; tools/evaluate.py
evaluates the others' saved policies). No tensorboard needed: the picture is a PNG (default: plot.png in the first
run's folder).
"""

import argparse
import json
import sys
from pathlib import Path

REWARD_KEYS = ("objective/rlhf_reward", "objective/scores", "objective/accuracy")


def read_jsonl(path: Path):
    """The rows of a JSONL file, [] if it does not exist; a broken line fails naming the file and the line."""
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                sys.exit(f"error: {path}:{number} is not valid JSON")
    return rows


def load_run(folder: Path):
    """(label, metrics rows, evaluation rows) of a run folder."""
    if not (folder / "metrics.jsonl").exists():
        sys.exit(f"error: {folder} is not a run folder (no metrics.jsonl there)")
    metrics = read_jsonl(folder / "metrics.jsonl")
    if not metrics:
        sys.exit(f"error: {folder / 'metrics.jsonl'} is empty: the run logged no step yet")
    return folder.name, metrics, read_jsonl(folder / "eval.jsonl")


def plot(runs, out: Path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    reward_key = next(key for key in REWARD_KEYS if all(key in run[1][0] for run in runs))
    panels = [(reward_key, "reward")]
    if all("objective/kl" in run[1][0] for run in runs):
        panels.append(("objective/kl", "KL to the reference"))
    has_eval = any(run[2] for run in runs)
    fig, axes = plt.subplots(1, len(panels) + has_eval, figsize=(5 * (len(panels) + has_eval), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for label, metrics, _ in runs:
            ax.plot([m["step"] for m in metrics], [m[key] for m in metrics], marker=".", label=label)
        ax.set(title=f"{title} ({key})", xlabel="learner step")
    if has_eval:
        ax = axes[0][-1]
        for label, _, evals in runs:
            if evals:
                ax.plot(
                    [e["policy_version"] for e in evals], [e["eval/accuracy"] for e in evals], marker="o", label=label
                )
        ax.set(title="held-out greedy accuracy (eval/accuracy)", xlabel="policy version", ylim=(0, 1))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (runs/{run_name})")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: plot.png in the first run)")
    cli = parser.parse_args()
    runs = [load_run(folder) for folder in cli.runs]
    if not any(all(key in run[1][0] for run in runs) for key in REWARD_KEYS):
        sys.exit("error: these runs share no reward metric (" + ", ".join(REWARD_KEYS) + ")")
    print(f"wrote {plot(runs, cli.out or cli.runs[0] / 'plot.png')}")
