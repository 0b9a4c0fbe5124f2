"""Speed table: sync vs async wall time per learner step, for every algorithm pair, in one invocation.

    python benchmark/speed.py                 # embedded SmolLM2-135M-Instruct; ~1 h on a 2-core CPU
    python benchmark/speed.py --algorithms dpo --measured-steps 4
    python benchmark/speed.py --quick --policy P --reward-model R --prompts F --results-dir D   # test suite smoke run

For each algorithm, three runs with the same prompts, seed and number of learner steps:
  sync        the sync baseline with all cores given to each phase in turn (the realistic baseline)
  sync_split  the sync baseline with one thread per role, the split the async run uses (isolates the overlap)
  async       the async script, --async-steps 1, one thread for the engine and one for the learner
On a CPU the overlap only pays when generation and learning do not fight for the same cores, the way the paper gives
generation its own GPU: the in-process engine and the learner each get one torch/OpenMP thread, so each has a core.
Every run writes one result file; a rerun skips finished runs (--force redoes them). The table and plot are rebuilt
from the result files every time (`--report-only` does only that).
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import tyro

REPO = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = REPO / "data" / "gsm8k" / "train.jsonl"  # prepared by install.sh, like the arithmetic problems
ARITHMETIC = REPO / "data" / "arithmetic"

# Per algorithm: its two scripts and the flags that make one learner step cost about as much as in the others.
# {policy}, {reward_model}, {prompts} are filled in at run time.
# Every algorithm generates and trains on 8 sequences of at most 48 new tokens per learner step.
RM_FLAGS = ["--model-name-or-path", "{policy}", "--reward-model-path", "{reward_model}", "--dataset-name", "{prompts}",
            "--max-prompt-tokens", "128", "--response-length", "48", "--learning-rate", "1e-6"]
ALGORITHMS = {
    "dpo": dict(async_script="async_dpo.py", sync_script="sync_baselines/sync_dpo.py",
                flags=RM_FLAGS + ["--prompts-per-step", "4", "--num-samples-per-prompt", "2"]),
    "rloo": dict(async_script="async_rloo.py", sync_script="sync_baselines/sync_rloo.py",
                 flags=RM_FLAGS + ["--prompts-per-step", "4", "--num-samples-per-prompt", "2"]),
    "ppo": dict(async_script="async_ppo.py", sync_script="sync_baselines/sync_ppo.py",
                flags=RM_FLAGS + ["--prompts-per-step", "8", "--num-samples-per-prompt", "1"]),
    # no reward model: the verifier grades generated arithmetic problems; held-out evaluation off (not a step cost)
    "grpo_gsm8k": dict(async_script="async_grpo_gsm8k.py", sync_script="sync_baselines/sync_grpo_gsm8k.py",
                       flags=["--model-name-or-path", "{policy}", "--dataset-path", str(ARITHMETIC),
                              "--max-prompt-tokens", "128", "--response-length", "48", "--learning-rate", "1e-6",
                              "--prompts-per-step", "2", "--num-samples-per-prompt", "4", "--num-eval-prompts", "0"]),
}
VARIANTS = {
    "sync": ("sync_script", ["--torch-threads", "2"]),
    "sync_split": ("sync_script", ["--torch-threads", "1"]),
    "async": ("async_script", ["--torch-threads", "1", "--async-steps", "1"]),
}


@dataclass
class Args:
    algorithms: List[str] = field(default_factory=lambda: list(ALGORITHMS))
    """algorithms to run (those whose scripts exist)"""
    warmup_steps: int = 1
    """learner steps excluded from the timing (engine warm-up, allocator growth)"""
    measured_steps: int = 3
    """learner steps timed after the warm-up"""
    policy: Optional[str] = None
    """policy model folder; None: models/SmolLM2-135M-Instruct (made by install.sh)"""
    reward_model: Optional[str] = None
    """reward model folder; None: a random-head classifier on SmolLM2, made once under benchmark/work (speed only)"""
    prompts: Optional[str] = None
    """prompt JSONL with a `query` field; None: made once from GSM8K train questions under benchmark/work"""
    results_dir: str = str(REPO / "benchmark" / "results")
    """where result files, speed.md and speed.png go"""
    work_dir: str = str(REPO / "benchmark" / "work")
    """scratch space (git-ignored): run folders, prepared models"""
    quick: bool = False
    """smoke mode for the test suite: 1 warm-up + 2 measured steps"""
    force: bool = False
    """rerun runs whose result file exists"""
    report_only: bool = False
    """only rebuild speed.md and speed.png from existing result files"""


def prepare_inputs(args: Args):
    """Fill in default models and prompts, building the speed-only reward model and prompt file once."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    args.policy = args.policy or str(REPO / "models" / "SmolLM2-135M-Instruct")
    if not Path(args.policy, "config.json").exists():
        sys.exit(f"error: no model at {args.policy}; run `bash install.sh` first")
    if args.reward_model is None:
        args.reward_model = str(work / "SmolLM2-rm")
        if not Path(args.reward_model, "config.json").exists():
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            torch.manual_seed(0)  # the head is random: its scores only need to be deterministic, not meaningful
            rm = AutoModelForSequenceClassification.from_pretrained(args.policy, num_labels=1)
            rm.save_pretrained(args.reward_model)
            AutoTokenizer.from_pretrained(args.policy).save_pretrained(args.reward_model)
    if args.prompts is None:
        args.prompts = str(work / "prompts.jsonl")
        if not Path(args.prompts).exists():
            with open(GSM8K_TRAIN) as src, open(args.prompts, "w") as dst:
                for line in list(src)[:512]:
                    dst.write(json.dumps({"query": json.loads(line)["question"] + "\nTL;DR:"}) + "\n")


def run_variant(args: Args, algo: str, variant: str, result_path: Path):
    spec = ALGORITHMS[algo]
    script_key, variant_flags = VARIANTS[variant]
    steps = args.warmup_steps + args.measured_steps
    flags = [f.format(policy=args.policy, reward_model=args.reward_model, prompts=args.prompts) for f in spec["flags"]]
    cwd = Path(args.work_dir) / f"{algo}__{variant}"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / spec[script_key]), *flags, *variant_flags, "--num-learner-steps", str(steps),
           "--seed", "1", "--sample-every", "1000", "--output-dir", str(cwd / "model")]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    print(f"== {algo} {variant}: {' '.join(cmd)}", flush=True)
    start = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {algo} {variant} failed:\n{proc.stderr[-5000:]}")
    (metrics_path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    result = dict(algorithm=algo, variant=variant, command=cmd[1:], warmup_steps=args.warmup_steps,
                  process_seconds=time.time() - start, date=time.strftime("%Y-%m-%d %H:%M"),
                  machine=f"{platform.machine()}, {os.cpu_count()} cores",
                  metrics=[json.loads(line) for line in metrics_path.read_text().splitlines()])
    result_path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)  # the saved model is large and not needed


def check_same_steps(path: Path, args: Args):
    """A finished run is only reused if it timed the same steps; a silent mix would corrupt the table."""
    done = json.loads(path.read_text())
    steps = int(done["command"][done["command"].index("--num-learner-steps") + 1])
    if (done["warmup_steps"], steps - done["warmup_steps"]) != (args.warmup_steps, args.measured_steps):
        sys.exit(f"error: {path} was made with {done['warmup_steps']} warm-up + {steps - done['warmup_steps']} "
                 f"measured steps, this invocation asks for {args.warmup_steps} + {args.measured_steps}; "
                 "pass --force to rerun it or --results-dir to keep both")


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def summarize(result):
    """Per-step means over the measured (post-warm-up) steps of one run."""
    warm = result["warmup_steps"]
    m = result["metrics"]
    timed = m[warm:]
    return dict(
        step_time=(m[-1]["time/elapsed"] - m[warm - 1]["time/elapsed"]) / len(timed) if warm else
        m[-1]["time/elapsed"] / len(m),
        generation=mean(x["time/generation"] + x.get("time/reward_labeling", 0.0) for x in timed),
        training=mean(x["time/training"] for x in timed),
        weight_sync=mean(x["time/weight_sync"] for x in timed),
        learner_waiting=mean(x["time/learner_waiting"] for x in timed),
        actor_waiting=mean(x["time/actor_waiting"] for x in timed),
    )


def secs(x: float) -> str:
    """Seconds for the table; below one second keep three decimals so that --quick runs do not print as 0.0."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def report(results_dir: Path):
    """Rebuild speed.md and speed.png from the result files."""
    rows, plot_rows = [], []
    for algo in ALGORITHMS:
        runs = {}
        for variant in VARIANTS:
            path = results_dir / "speed" / f"{algo}__{variant}.json"
            if path.exists():
                runs[variant] = json.loads(path.read_text())
        if len(runs) < len(VARIANTS):
            continue
        s = {v: summarize(r) for v, r in runs.items()}
        # G and T from the split sync run: each phase alone, on the same one-thread-per-role split as async
        g, t = s["sync_split"]["generation"], s["sync_split"]["training"]
        bound = (g + t) / max(g, t)
        speedup_split = s["sync_split"]["step_time"] / s["async"]["step_time"]
        speedup_sync = s["sync"]["step_time"] / s["async"]["step_time"]
        gap = 100 * (speedup_split - 1) / (bound - 1) if bound > 1.001 else float("nan")
        rows.append(
            f"| {algo} | {secs(s['sync']['step_time'])} | {secs(s['sync_split']['step_time'])} | "
            f"{secs(s['async']['step_time'])} | {speedup_sync:.2f}x | {speedup_split:.2f}x | {secs(g)} | {secs(t)} | "
            f"{bound:.2f}x | {100 * speedup_split / bound:.0f}% | {gap:.0f}% | "
            f"{100 * s['async']['weight_sync'] / s['async']['step_time']:.1f}% | "
            f"{secs(s['async']['learner_waiting'])} / {secs(s['async']['actor_waiting'])} | "
            f"{secs(s['sync_split']['learner_waiting'])} / {secs(s['sync_split']['actor_waiting'])} |")
        plot_rows.append((algo, s, bound))
    header = (
        "| algorithm | sync s/step (2 threads) | sync s/step (1+1 split) | async s/step (1+1) | speedup vs sync | "
        "speedup vs split sync | G s/step | T s/step | ideal bound (G+T)/max(G,T) | speedup / bound | "
        "overlap achieved | "
        "weight sync share (async) | async idle s/step learner / engine | split-sync idle s/step learner / engine |\n"
        "|" + "---|" * 14)
    (results_dir / "speed.md").write_text(
        "Wall time per learner step after warm-up (lower is better). G = generation + reward labeling, T = training,\n"
        "both from the split sync run. 'Speedup / bound' is the speedup over the split sync as a fraction of the "
        "ideal\nbound (the target is >= 90%); 'overlap achieved' = (speedup - 1) / (bound - 1), the share of the "
        "ideal saving\n"
        "that async realised. Produced by `python benchmark/speed.py`.\n\n" + header + "\n" +
        "\n".join(rows) + "\n")
    if plot_rows:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(plot_rows), 3.6))
        width = 0.25
        for i, (algo, s, bound) in enumerate(plot_rows):
            colors = (("sync", "#999999"), ("sync_split", "#5b8bd0"), ("async", "#d0785b"))
            for j, (variant, color) in enumerate(colors):
                ax.bar(i + (j - 1) * width, s[variant]["step_time"], width, color=color,
                       label=variant if i == 0 else None)
            ideal = s["sync_split"]["step_time"] / bound
            ax.hlines(ideal, i - 1.5 * width, i + 1.5 * width, colors="k", linestyles="dashed",
                      label="ideal async (split sync / bound)" if i == 0 else None)
        ax.set_xticks(range(len(plot_rows)), [r[0] for r in plot_rows])
        ax.set_ylabel("seconds per learner step")
        ax.set_title("sync vs async, SmolLM2-135M on a 2-core CPU")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(results_dir / "speed.png", dpi=120)
    return rows


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:  # shrinks only what was left at its default: explicit flags win
        defaults = Args()
        args.measured_steps = 2 if args.measured_steps == defaults.measured_steps else args.measured_steps
    unknown = [a for a in args.algorithms if a not in ALGORITHMS]
    if unknown:
        sys.exit(f"error: unknown --algorithms {unknown}; known: {list(ALGORITHMS)}")
    results_dir = Path(args.results_dir)
    (results_dir / "speed").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        prepare_inputs(args)
        for algo in args.algorithms:
            for variant in VARIANTS:
                path = results_dir / "speed" / f"{algo}__{variant}.json"
                if path.exists() and not args.force:
                    check_same_steps(path, args)
                    print(f"== {algo} {variant}: done already ({path})")
                    continue
                run_variant(args, algo, variant, path)
    rows = report(results_dir)
    print((results_dir / "speed.md").read_text())
