"""Speed table: sync vs async wall time per learner step, for every algorithm pair, in one invocation.

    python benchmark/speed.py                 # the table: embedded SmolLM2-135M-Instruct; ~1 h on a 2-core CPU
    python benchmark/speed.py --settings dpo --measured-steps 4
    python benchmark/speed.py --settings dpo_k4 dpo_k6 dpo_k8 rloo_p2 grpo_p1 --variants sync_split --measured-steps 5
    python benchmark/speed.py --settings dpo_k6 --measured-steps 5 --repeats 3    # a balanced setting, repeated
    python benchmark/speed.py --quick --policy P --reward-model R --prompts F --results-dir D   # test suite smoke run

For each setting, three runs with the same prompts, seed and number of learner steps:
  sync        the sync baseline with all cores given to each phase in turn (the realistic baseline)
  sync_split  the sync baseline with one thread per role, the split the async run uses (isolates the overlap)
  async       the async script, --async-steps 1, one thread for the engine and one for the learner
On a CPU the overlap only pays when generation and learning do not fight for the same cores, the way the paper gives
generation its own GPU: the in-process engine and the learner each get one torch/OpenMP thread, so each has a core.
Two sets of settings: the table's (8 sequences per step, where training costs 2-4x generation) and balanced ones,
where generation costs about as much as training (the paper's Sec. 5 regime: best-of-k DPO with more samples, smaller
RLOO/GRPO batches), found by a sweep of split-sync runs that reports G/T per setting.
Every run writes one result file; a rerun skips finished runs (--force redoes them). The tables and plots are rebuilt
from the result files every time (`--report-only` does only that).
"""

import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import tyro

import common

REPO = common.REPO
GSM8K_TRAIN = REPO / "data" / "gsm8k" / "train.jsonl"  # prepared by install.sh, like the arithmetic problems
ARITHMETIC = REPO / "data" / "arithmetic"

# Per setting: the algorithm (its two scripts) and the flags. {policy}, {reward_model}, {prompts} are filled in at run
# time. The table's four generate and train 8 sequences of at most 48 new tokens per learner step.
RM_FLAGS = [
    "--model-name-or-path",
    "{policy}",
    "--reward-model-path",
    "{reward_model}",
    "--dataset-name",
    "{prompts}",
    "--max-prompt-tokens",
    "128",
    "--response-length",
    "48",
    "--learning-rate",
    "1e-6",
]
# no reward model: the verifier grades generated arithmetic problems; held-out evaluation off (not a step cost)
GRPO_FLAGS = [
    "--model-name-or-path",
    "{policy}",
    "--dataset-path",
    str(ARITHMETIC),
    "--max-prompt-tokens",
    "128",
    "--response-length",
    "48",
    "--learning-rate",
    "1e-6",
    "--num-eval-prompts",
    "0",
]
SCRIPTS = {
    algo: dict(async_script=f"async_{algo}.py", sync_script=f"sync_baselines/sync_{algo}.py")
    for algo in ("dpo", "rloo", "ppo", "grpo_gsm8k")
}
for algo in ("dpo", "grpo_gsm8k"):  # the algorithms with a LoRA variant (issue 56)
    SCRIPTS[algo]["lora_script"] = f"async_{algo}_lora.py"


def sized(prompts: int, samples: int):
    return ["--prompts-per-step", str(prompts), "--num-samples-per-prompt", str(samples)]


SETTINGS = {
    # the table: training costs 2-4x generation at these sizes
    "dpo": dict(algo="dpo", flags=RM_FLAGS + sized(4, 2)),
    "rloo": dict(algo="rloo", flags=RM_FLAGS + sized(4, 2)),
    "ppo": dict(algo="ppo", flags=RM_FLAGS + sized(8, 1)),
    "grpo_gsm8k": dict(algo="grpo_gsm8k", flags=GRPO_FLAGS + sized(2, 4)),
    # balance candidates: best-of-k DPO trains on one pair per prompt whatever k is, so more samples cost generation
    # only; a smaller RLOO/GRPO batch shrinks training in proportion but generation less (decoding a few sequences
    # at once costs about what one costs)
    **{f"dpo_k{k}": dict(algo="dpo", flags=RM_FLAGS + sized(4, k)) for k in (4, 6, 8)},
    "rloo_p2": dict(algo="rloo", flags=RM_FLAGS + sized(2, 2)),
    "grpo_p1": dict(algo="grpo_gsm8k", flags=GRPO_FLAGS + sized(1, 4)),
}
TABLE = ["dpo", "rloo", "ppo", "grpo_gsm8k"]
VARIANTS = {
    "sync": ("sync_script", ["--torch-threads", "2"]),
    "sync_split": ("sync_script", ["--torch-threads", "1"]),
    "async": ("async_script", ["--torch-threads", "1", "--async-steps", "1"]),
    # the LoRA variant's async run beside the core's (issue 56: what an adapter changes in the balanced step)
    "async_lora": (
        "lora_script",
        ["--torch-threads", "1", "--async-steps", "1", "--lora-rank", "16", "--lora-alpha", "32"],
    ),
}
CORE_VARIANTS = ["sync", "sync_split", "async"]


@dataclass
class Args:
    settings: List[str] = field(default_factory=lambda: list(TABLE))
    """settings to run: the table's four (one per algorithm) and/or the balance candidates of SETTINGS"""
    variants: List[str] = field(default_factory=lambda: list(CORE_VARIANTS))
    """which runs to make: the three of the table (sync_split alone gives G and T, for the balance sweep), or
    async_lora (DPO and GRPO settings: the LoRA variant at rank 16, beside async)"""
    repeats: int = 1
    """runs of each variant (result files __r2, __r3, ...), for the spread of the speedups"""
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
    results_dir: str = str(REPO / "benchmark" / "results" / "speed")
    """where result files, speed.md, speed.png and speed_balance.png go"""
    work_dir: str = str(REPO / "benchmark" / "work")
    """scratch space (git-ignored): run folders, prepared models"""
    quick: bool = False
    """smoke mode for the test suite: 1 warm-up + 2 measured steps"""
    force: bool = False
    """rerun runs whose result file exists"""
    report_only: bool = False
    """only rebuild speed.md and the plots from existing result files"""


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


def result_path(results_dir: Path, setting: str, variant: str, repeat: int):
    return results_dir / "runs" / f"{setting}__{variant}{f'__r{repeat}' if repeat > 1 else ''}.json"


def run_variant(args: Args, setting: str, variant: str, path: Path):
    spec = SETTINGS[setting]
    script_key, variant_flags = VARIANTS[variant]
    steps = args.warmup_steps + args.measured_steps
    flags = [f.format(policy=args.policy, reward_model=args.reward_model, prompts=args.prompts) for f in spec["flags"]]
    cwd = Path(args.work_dir) / f"{setting}__{variant}"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [
        sys.executable,
        str(REPO / SCRIPTS[spec["algo"]][script_key]),
        *flags,
        *variant_flags,
        "--num-learner-steps",
        str(steps),
        "--seed",
        "1",
        "--sample-every",
        "1000",
        "--output-dir",
        str(cwd / "model"),
    ]
    print(f"== {setting} {variant}: {' '.join(cmd)}", flush=True)
    start = time.time()
    common.run_script(cmd, cwd, f"{setting} {variant}", env=common.QUIET)
    (metrics_path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    result = dict(
        setting=setting,
        algorithm=spec["algo"],
        variant=variant,
        command=cmd[1:],
        warmup_steps=args.warmup_steps,
        process_seconds=time.time() - start,
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        metrics=[json.loads(line) for line in metrics_path.read_text().splitlines()],
    )
    path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)  # the saved model is large and not needed


def check_same_steps(path: Path, args: Args):
    """A finished run is only reused if it timed the same steps; a silent mix would corrupt the table."""
    done = json.loads(path.read_text())
    steps = int(done["command"][done["command"].index("--num-learner-steps") + 1])
    if (done["warmup_steps"], steps - done["warmup_steps"]) != (args.warmup_steps, args.measured_steps):
        sys.exit(
            f"error: {path} was made with {done['warmup_steps']} warm-up + {steps - done['warmup_steps']} "
            f"measured steps, this invocation asks for {args.warmup_steps} + {args.measured_steps}; "
            "pass --force to rerun it or --results-dir to keep both"
        )


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def summarize(result):
    """Per-step means over the measured (post-warm-up) steps of one run."""
    warm = result["warmup_steps"]
    m = result["metrics"]
    timed = m[warm:]
    return dict(
        step_time=(m[-1]["time/elapsed"] - m[warm - 1]["time/elapsed"]) / len(timed)
        if warm
        else m[-1]["time/elapsed"] / len(m),
        generation=mean(x["time/generation"] + x.get("time/reward_labeling", 0.0) for x in timed),
        training=mean(x["time/training"] for x in timed),
        weight_sync=mean(x["time/weight_sync"] for x in timed),
        learner_waiting=mean(x["time/learner_waiting"] for x in timed),
        actor_waiting=mean(x["time/actor_waiting"] for x in timed),
        measured_steps=len(timed),
    )


def secs(x: float) -> str:
    """Seconds for the table; below one second keep three decimals so that --quick runs do not print as 0.0."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def med(runs, key):
    """median of one number over runs (repeats)"""
    return statistics.median(r[key] for r in runs)


def spread(values, fmt="{:.2f}x"):
    """median, and [min-max] when there is more than one value"""
    values = sorted(values)
    text = fmt.format(statistics.median(values))
    return text if len(values) == 1 else f"{text} [{fmt.format(values[0])}-{fmt.format(values[-1])}]"


def load_runs(results_dir: Path):
    """{setting: {variant: [summary of repeat 1, 2, ...]}} from the result files (repeats numbered without gaps)."""
    runs = {}
    for setting in SETTINGS:
        for variant in VARIANTS:
            repeat = 1
            while result_path(results_dir, setting, variant, repeat).exists():
                result = json.loads(result_path(results_dir, setting, variant, repeat).read_text())
                runs.setdefault(setting, {}).setdefault(variant, []).append(summarize(result))
                repeat += 1
    return runs


def compare(runs):
    """Per setting with all three variants: each repeat's numbers (repeat r of each variant together), and the
    per-core speed-ups s_G, s_T of each phase when the sync run gets both cores."""
    rows = {}
    for setting, by_variant in runs.items():
        if not set(CORE_VARIANTS) <= set(by_variant):
            continue
        per_repeat = []
        for sync, split, run in zip(by_variant["sync"], by_variant["sync_split"], by_variant["async"]):
            g, t = split["generation"], split["training"]
            per_repeat.append(
                dict(
                    g=g,
                    t=t,
                    sync=sync["step_time"],
                    split=split["step_time"],
                    async_=run["step_time"],
                    s_g=g / sync["generation"],
                    s_t=t / sync["training"],
                    bound_split=(g + t) / max(g, t),
                    # what async could gain over the 2-thread sync: that sync's measured phases against max(G, T)
                    bound_sync=(sync["generation"] + sync["training"]) / max(g, t),
                    # stricter: the 2-thread sync's whole step, which also pays the weight sync (and logging) in series,
                    # over the slower phase alone, i.e. perfect overlap with a free hand-off
                    bound_sync_step=sync["step_time"] / max(g, t),
                    speedup_split=split["step_time"] / run["step_time"],
                    speedup_sync=sync["step_time"] / run["step_time"],
                    weight_sync_share=run["weight_sync"] / run["step_time"],
                    idle_async=(run["learner_waiting"], run["actor_waiting"]),
                    idle_split=(split["learner_waiting"], split["actor_waiting"]),
                    steps=run["measured_steps"],
                )
            )
        rows[setting] = per_repeat
    return rows


def lora_lines(runs):
    """The LoRA variant's async runs beside the core's, per setting with both (repeat r of each compared)."""
    rows = []
    for setting, by_variant in runs.items():
        pairs = list(zip(by_variant.get("async", []), by_variant.get("async_lora", [])))
        if not pairs:
            continue
        both = lambda key: (
            f"{secs(statistics.median(f[key] for f, _ in pairs))} / "
            + secs(statistics.median(lo[key] for _, lo in pairs))
        )
        share = lambda run: 100 * run["weight_sync"] / run["step_time"]
        rows.append(
            f"| {setting} | {both('step_time')} | {spread([lo['step_time'] / f['step_time'] for f, lo in pairs])} | "
            f"{both('generation')} | {both('training')} | {both('weight_sync')} | "
            f"{statistics.median(share(f) for f, _ in pairs):.1f}% / {statistics.median(share(lo) for _, lo in pairs):.1f}% | "
            f"{len(pairs)} x {pairs[0][0]['measured_steps']} |"
        )
    if not rows:
        return ""
    return (
        "\nLoRA (issue 56): the LoRA variant (`async_<algo>_lora.py --lora-rank 16 --lora-alpha 32`) against the core, "
        "both async (1+1 threads), per learner step after warm-up; full / LoRA, medians over runs. Weight sync: "
        "`time/weight_sync` (the generation thread's push and guard: full weights, or one adapter), its share of the "
        "step.\n\n"
        "| setting | async s/step, full / LoRA | LoRA / full | generation s/step | training s/step | weight sync s/step | "
        "weight sync share | runs x timed steps |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def report(results_dir: Path):
    """Rebuild speed.md, speed.png (bars) and speed_balance.png (speedup against G/T) from the result files."""
    runs = load_runs(results_dir)
    rows = compare(runs)
    table = []
    for setting, rs in rows.items():
        gap = [
            100 * (r["speedup_split"] - 1) / (r["bound_split"] - 1) if r["bound_split"] > 1.001 else float("nan")
            for r in rs
        ]
        table.append(
            f"| {setting} | {secs(med(rs, 'sync'))} | {secs(med(rs, 'split'))} | {secs(med(rs, 'async_'))} | "
            f"{spread([r['speedup_sync'] for r in rs])} | {spread([r['speedup_split'] for r in rs])} | "
            f"{secs(med(rs, 'g'))} | {secs(med(rs, 't'))} | {med(rs, 'bound_split'):.2f}x | "
            f"{100 * med(rs, 'speedup_split') / med(rs, 'bound_split'):.0f}% | {statistics.median(gap):.0f}% | "
            f"{med(rs, 'bound_sync'):.2f}x | {100 * med(rs, 'speedup_sync') / med(rs, 'bound_sync'):.0f}% | "
            f"{med(rs, 'bound_sync_step'):.2f}x | "
            f"{100 * med(rs, 'speedup_sync') / med(rs, 'bound_sync_step'):.0f}% | "
            f"{100 * med(rs, 'weight_sync_share'):.1f}% | "
            f"{secs(statistics.median(r['idle_async'][0] for r in rs))} / "
            f"{secs(statistics.median(r['idle_async'][1] for r in rs))} | "
            f"{secs(statistics.median(r['idle_split'][0] for r in rs))} / "
            f"{secs(statistics.median(r['idle_split'][1] for r in rs))} | {len(rs)} x {rs[0]['steps']} |"
        )
    header = (
        "| setting | sync s/step (2 threads) | sync s/step (1+1 split) | async s/step (1+1) | speedup vs sync | "
        "speedup vs split sync | G s/step | T s/step | ideal vs split (G+T)/max(G,T) | speedup / that ideal | "
        "overlap achieved | ideal vs sync | speedup / that ideal | ideal vs sync, whole step | speedup / that ideal | "
        "weight sync share (async) | async idle s/step learner / engine | split-sync idle s/step learner / engine | "
        "runs x timed steps |\n"
        "|" + "---|" * 19
    )
    # the balance sweep: G and T of every setting that has split-sync runs
    balance = []
    for setting, by_variant in runs.items():
        if "sync_split" in by_variant:
            split = by_variant["sync_split"]
            g, t = med(split, "generation"), med(split, "training")
            flags = SETTINGS[setting]["flags"]
            size = " x ".join(
                flags[flags.index(flag) + 1] for flag in ("--prompts-per-step", "--num-samples-per-prompt")
            )
            balance.append(
                f"| {setting} | {SETTINGS[setting]['algo']} | {size} | {secs(g)} | {secs(t)} | "
                f"{g / t:.2f} | {len(split)} |"
            )
    lora = lora_lines(runs)
    (results_dir / "speed.md").write_text(
        "Wall time per learner step after warm-up (lower is better); with several runs per variant, the median and "
        "[min-max]\nof the per-run speedups (run r of each variant compared). G = generation + reward labeling, "
        "T = training, both\nfrom the split sync run. 'Ideal vs split' = (G+T)/max(G,T); 'overlap achieved' = "
        "(speedup - 1) / (ideal - 1)\nagainst the split sync. 'Ideal vs sync' = the 2-thread sync's own G + T over "
        "max(G, T): what perfect overlap on one\ncore per role would gain over both cores for each phase in turn.\n"
        "'Whole step': the 2-thread sync's s/step over max(G, T), stricter, since that sync also pays the weight sync "
        "in\nseries, which async overlaps.\n"
        "Produced by `python benchmark/speed.py`.\n\n" + header + "\n" + "\n".join(table) + "\n\n"
        "Balance: G and T per setting from its split-sync runs (median), G/T = 1 is where overlap pays most.\n\n"
        "| setting | algorithm | prompts x samples | G s/step | T s/step | G/T | runs |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(balance) + "\n" + lora
    )
    if rows:
        plot(rows, results_dir)
    return table


def plot(rows, results_dir: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(rows), 3.6))
    width = 0.25
    for i, (setting, rs) in enumerate(rows.items()):
        for j, (key, variant, color) in enumerate(
            (("sync", "sync", "#999999"), ("split", "sync_split", "#5b8bd0"), ("async_", "async", "#d0785b"))
        ):
            ax.bar(i + (j - 1) * width, med(rs, key), width, color=color, label=variant if i == 0 else None)
        ax.hlines(
            med(rs, "split") / med(rs, "bound_split"),
            i - 1.5 * width,
            i + 1.5 * width,
            colors="k",
            linestyles="dashed",
            label="ideal async (split sync / bound)" if i == 0 else None,
        )
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("seconds per learner step")
    ax.set_title("sync vs async, SmolLM2-135M on a 2-core CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir / "speed.png", dpi=120)
    plt.close(fig)

    # speedup against G/T: where async pays off, with the ideal curves; s_G, s_T = the median measured per-core
    # speed-ups of each phase (G1/G2, T1/T2), which set what the 2-thread sync gains by using both cores
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    s_g = statistics.median(r["s_g"] for rs in rows.values() for r in rs)
    s_t = statistics.median(r["s_t"] for rs in rows.values() for r in rs)
    ratio = [0.1 * 1.05**i for i in range(int(math.log(40) / math.log(1.05)))]
    ax.plot(
        ratio,
        [(1 + x) / max(1, x) for x in ratio],
        color="#5b8bd0",
        lw=1,
        ls="--",
        label="ideal vs split sync: (G+T)/max(G,T)",
    )
    ax.plot(
        ratio,
        [(x / s_g + 1 / s_t) / max(1, x) for x in ratio],
        color="#555555",
        lw=1,
        ls="--",
        label=f"ideal vs 2-thread sync: (G/s_G + T/s_T)/max(G,T), s_G={s_g:.2f}, s_T={s_t:.2f}",
    )
    for key, color, label in (
        ("speedup_split", "#5b8bd0", "measured vs split sync"),
        ("speedup_sync", "#333333", "measured vs 2-thread sync"),
    ):
        for k, (setting, rs) in enumerate(rows.items()):
            x, ys = med(rs, "g") / med(rs, "t"), [r[key] for r in rs]
            y = statistics.median(ys)
            ax.errorbar(
                [x],
                [y],
                yerr=[[y - min(ys)], [max(ys) - y]],
                fmt="o",
                color=color,
                ms=4,
                capsize=2,
                label=label if k == 0 else None,
            )
            if key == "speedup_sync":
                ax.annotate(setting, (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("G/T (generation / training seconds per step, split sync)")
    ax.set_ylabel("async speedup")
    ax.set_title("Where async pays off: SmolLM2-135M, 2-core CPU", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results_dir / "speed_balance.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:  # shrinks only what was left at its default: explicit flags win
        defaults = Args()
        args.measured_steps = 2 if args.measured_steps == defaults.measured_steps else args.measured_steps
    for flag, given, known in (("--settings", args.settings, SETTINGS), ("--variants", args.variants, VARIANTS)):
        if [x for x in given if x not in known]:
            sys.exit(f"error: unknown {flag} {[x for x in given if x not in known]}; known: {list(known)}")
    no_lora = [
        s for s in args.settings if "async_lora" in args.variants and "lora_script" not in SCRIPTS[SETTINGS[s]["algo"]]
    ]
    if no_lora:
        sys.exit(f"error: --variants async_lora needs a LoRA variant, which {no_lora} have not (DPO and GRPO have one)")
    if args.repeats < 1:
        sys.exit(f"error: --repeats must be >= 1, got {args.repeats}")
    results_dir = Path(args.results_dir)
    (results_dir / "runs").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        prepare_inputs(args)
        for repeat in range(1, args.repeats + 1):  # repeats interleaved: slow drifts of the machine hit all variants
            for setting in args.settings:
                for variant in args.variants:
                    path = result_path(results_dir, setting, variant, repeat)
                    if path.exists() and not args.force:
                        check_same_steps(path, args)
                        print(f"== {setting} {variant} (run {repeat}): done already ({path})")
                        continue
                    run_variant(args, setting, variant, path)
    rows = report(results_dir)
    print((results_dir / "speed.md").read_text())
