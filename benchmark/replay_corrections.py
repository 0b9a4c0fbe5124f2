"""Three off-policy corrections on the very same samples: how much of their difference is the correction, and how much
was sampling noise? Record and replay (docs/multigpu.md#record-and-replay) at the staleness benchmark's K=8 RLOO.

    python benchmark/replay_corrections.py                 # the measurement: results/replay_corrections/ (~1 h)
    python benchmark/replay_corrections.py --report-only   # rebuild the table from the result files
    python benchmark/replay_corrections.py --quick --work-dir /tmp/rc --results-dir /tmp/rc   # smoke run (~8 min)

For each seed, multigpu/async_rloo_multigpu.py (one process, a real engine) trains at benchmark/staleness.py's K=8
RLOO setting (its prep: SFT policy and arithmetic problems; verifier reward, 16 prompts x 4 samples per step, 256
steps, its learning rate) under `--record-samples` and `--record-correction`; then the same script replays that
seed's recorded stream (`--replay-from`, no engine) once per correction. Each final policy is evaluated with
staleness.py's `evaluate_policy` (gold = verifier accuracy of T=0.7 samples on the held-out problems, KL to the SFT
policy). Within a seed every correction trains on identical samples, rewards and behaviour logprobs, so the spread
between corrections is the corrections' own; the spread between seeds within a correction adds the sampling of the
stream. The replay under the recorded correction must reproduce the recording bit for bit, and is checked.

Each piece (a recording, a replay and its evaluation) leaves a file; a rerun skips what is finished.
"""

import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import tyro

import common
import staleness  # the staleness benchmark's prep, run flags and evaluation, reused as they are

REPO = common.REPO

SCRIPT = "multigpu/async_rloo_multigpu.py"
CORRECTIONS = ("paper", "behaviour", "decoupled")


@dataclass
class Args:
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds: each records its own stream"""
    corrections: List[str] = field(default_factory=lambda: list(CORRECTIONS))
    """--off-policy-correction values each stream is replayed under"""
    record_correction: str = "paper"
    """the correction the recording run trains with (it shapes the later samples); its replay must equal it"""
    async_steps: int = 8
    """K of the recorded runs"""
    prep_dir: str = str(REPO / "benchmark" / "work" / "staleness")
    """benchmark/staleness.py's prep (SFT policy, data); built there if missing (~6 min), as its --prep-only does"""
    work_dir: str = str(REPO / "benchmark" / "work" / "replay_corrections")
    """scratch space (git-ignored): the recorded runs (kept: their samples are replayed) and the replays"""
    results_dir: str = str(REPO / "benchmark" / "results" / "replay_corrections")
    """where replay_corrections/*.json and replay_corrections.md go"""
    quick: bool = False
    """smoke mode: a tiny prep in --work-dir, 4 steps of 2 prompts, K=2, seeds 1 and 2"""
    report_only: bool = False
    """only rebuild replay_corrections.md from the result files"""


def staleness_args(args: Args):
    """The staleness benchmark's own Args (its defaults, or its --quick sizes), pointing at our prep folder."""
    sargs = staleness.Args(work_dir=args.prep_dir, quick=args.quick)
    if args.quick:
        staleness.quick_settings(sargs)
    return sargs


def run_flags(args: Args, sargs, seed: int):
    """The staleness sweep's K=8 RLOO run (staleness.run_one's flags, one step per update), minus its checkpoints."""
    flags = staleness.COMMON_FLAGS + staleness.VERIFIER + staleness.ALGORITHMS["rloo"]["flags"]
    flags = [
        f.replace("{sft}", str(Path(args.prep_dir) / "sft")).replace("{data}", str(Path(args.prep_dir) / "data"))
        for f in flags
    ]
    return [
        *flags,
        "--learning-rate",
        f"{staleness.ALGORITHMS['rloo']['learning_rate']:g}",
        "--async-steps",
        str(args.async_steps),
        "--seed",
        str(seed),
        "--prompts-per-step",
        str(sargs.mini_batch_prompts),
        "--num-learner-steps",
        str(sargs.num_updates),
        "--response-length",
        str(sargs.response_length),
    ]


def run(cwd: Path, flags):
    """The script in a subprocess under cwd; exits with its stderr's tail if it fails. Returns (run folder, seconds)."""
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / SCRIPT), *flags]
    print(f"== {cwd.name}: {' '.join(cmd)}", flush=True)
    start = time.time()
    common.run_script(cmd, cwd, cwd.name)
    (folder,) = (cwd / "runs").iterdir()
    return folder, time.time() - start


def record(args: Args, sargs, seed: int):
    """The recorded run of a seed (its run folder), recorded now unless done already (record.json marks it done)."""
    cwd = Path(args.work_dir) / f"record_seed{seed}"
    done = cwd / "record.json"
    if done.exists():
        return Path(json.loads(done.read_text())["run"])
    folder, seconds = run(
        cwd, [*run_flags(args, sargs, seed), "--off-policy-correction", args.record_correction, "--record-samples"]
    )
    done.write_text(json.dumps(dict(run=str(folder), seconds=round(seconds, 1))))
    return folder


def replay(args: Args, sargs, seed: int, correction: str, recorded: Path, task, path: Path):
    """Replay a seed's stream under a correction, evaluate the final policy, write the result file."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cwd = Path(args.work_dir) / f"replay_seed{seed}_{correction}"
    flags = [*run_flags(args, sargs, seed), "--off-policy-correction", correction, "--replay-from", str(recorded)]
    folder, seconds = run(cwd, flags)
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    start = time.time()
    torch.set_num_threads(sargs.prep_threads)
    prep = Path(args.prep_dir)
    tokenizer = AutoTokenizer.from_pretrained(prep / "sft")
    sft = AutoModelForCausalLM.from_pretrained(prep / "sft").eval()
    policy = AutoModelForCausalLM.from_pretrained(folder / "model").eval()
    test = [json.loads(line) for line in (prep / "data" / "test.jsonl").read_text().splitlines()]
    # the staleness sweep's evaluation seed for this run seed: every correction is scored on the same draws
    gold = staleness.evaluate_policy(
        policy, sft, tokenizer, task, staleness.encode(tokenizer, test), sargs, seed=1000 + seed
    )
    mean = lambda key: sum(m[key] for m in metrics) / len(metrics)
    result = dict(
        seed=seed,
        correction=correction,
        recorded_with=args.record_correction,
        **gold,
        async_steps=args.async_steps,
        eval_draws=len(test) * sargs.eval_samples,
        importance_weight_ess=mean("policy/importance_weight_ess"),
        zero_gradient_frac=mean("policy/zero_gradient_frac"),
        clipfrac=mean("policy/clipfrac"),
        logprob_gap=mean("async/behaviour_learner_logprob_gap"),
        steps=len(metrics),
        replay_seconds=round(seconds, 1),
        eval_seconds=round(time.time() - start, 1),
        command=flags,
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
    )
    if correction == args.record_correction:  # the replay of the run's own flags: the recorded weights, bit for bit
        a, b = load_file(folder / "model" / "model.safetensors"), load_file(recorded / "model" / "model.safetensors")
        result["max_weight_difference_to_recording"] = max((a[k] - b[k]).abs().max().item() for k in b)
    path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)
    print(
        f"   gold {gold['gold_reward']:.3f}  KL {gold['kl']:.3f}  ({seconds:.0f}s replay + "
        f"{result['eval_seconds']:.0f}s eval)",
        flush=True,
    )


def spread(values):
    """(max - min, sample standard deviation) of a list of numbers."""
    m = sum(values) / len(values)
    return max(values) - min(values), math.sqrt(sum((v - m) ** 2 for v in values) / max(1, len(values) - 1))


def report(results_dir: Path, quick: bool):
    """replay_corrections.md from the result files alone."""
    results = {
        (r["seed"], r["correction"]): r
        for r in (json.loads(p.read_text()) for p in sorted((results_dir / "runs").glob("*.json")))
    }
    seeds = sorted({s for s, _ in results})
    corrections = [c for c in CORRECTIONS if any(c == k for _, k in results)]
    k = {r["async_steps"] for r in results.values()}
    lines = [
        f"Three corrections on the same samples (issue 28): each seed's K={'/'.join(map(str, sorted(k)))} RLOO "
        "stream, recorded once by "
        "multigpu/async_rloo_multigpu.py under the correction in the recorded-with column, replayed "
        "(`--replay-from`) under each correction; gold = verifier accuracy of T=0.7 samples on the held-out "
        "problems, KL to the SFT policy (benchmark/staleness.py's evaluate_policy). Produced by `python "
        f"benchmark/replay_corrections.py{' --quick' * quick}`.",
        "",
        "| seed | recorded with | " + " | ".join(f"{c}: gold (KL)" for c in corrections) + " |",
        "|---|---|" + "---|" * len(corrections),
    ]
    for seed in seeds:
        row = [results.get((seed, c)) for c in corrections]
        recorded_with = next(r["recorded_with"] for r in row if r)
        lines.append(
            f"| {seed} | {recorded_with} | "
            + " | ".join(f"{r['gold_reward']:.3f} ({r['kl']:.3f})" if r else "–" for r in row)
            + " |"
        )
    complete = [s for s in seeds if all((s, c) in results for c in corrections)]
    if len(complete) >= 2 and len(corrections) >= 2:
        gold = {(s, c): results[(s, c)]["gold_reward"] for s in complete for c in corrections}
        between_corrections = [spread([gold[(s, c)] for c in corrections]) for s in complete]
        between_seeds = [spread([gold[(s, c)] for s in complete]) for c in corrections]
        mean = lambda pairs, i: sum(p[i] for p in pairs) / len(pairs)
        level = sum(gold.values()) / len(gold)
        noise = math.sqrt(level * (1 - level) / results[(complete[0], corrections[0])]["eval_draws"])
        lines += [
            "",
            "| spread of the final gold | range (max - min) | std |",
            "|---|---|---|",
            f"| between corrections, within a seed (mean over {len(complete)} seeds) | "
            f"{mean(between_corrections, 0):.3f} | {mean(between_corrections, 1):.3f} |",
            f"| between seeds, within a correction (mean over {len(corrections)} corrections) | "
            f"{mean(between_seeds, 0):.3f} | {mean(between_seeds, 1):.3f} |",
            "",
            "Per seed, the range between corrections: "
            + ", ".join(f"seed {s} {r[0]:.3f}" for s, r in zip(complete, between_corrections))
            + "; per correction, the range between seeds: "
            + ", ".join(f"{c} {r[0]:.3f}" for c, r in zip(corrections, between_seeds))
            + f". For scale, the binomial standard error of one evaluation at the mean gold {level:.3f} is "
            f"{noise:.3f} (held-out problems x samples; every run of a seed is scored on the same draws).",
        ]
    lines += [
        "",
        "| seed | correction | importance-weight ESS | zero-gradient fraction | clip fraction | "
        "engine-learner logprob gap | replay s | eval s | max |w - w_recorded| |",
        "|" + "---|" * 9,
    ]
    for (seed, c), r in sorted(results.items(), key=lambda item: (item[0][0], CORRECTIONS.index(item[0][1]))):
        check = r.get("max_weight_difference_to_recording")
        lines.append(
            f"| {seed} | {c} | {r['importance_weight_ess']:.3f} | {r['zero_gradient_frac']:.3f} | "
            f"{r['clipfrac']:.3f} | {r['logprob_gap']:.2e} | {r['replay_seconds']:.0f} | "
            f"{r['eval_seconds']:.0f} | {'' if check is None else f'{check:g}'} |"
        )
    (results_dir / "replay_corrections.md").write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        args.seeds, args.async_steps = args.seeds[:2], 2
        args.prep_dir = str(Path(args.work_dir) / "prep") if args.prep_dir == Args.prep_dir else args.prep_dir
    unknown = [c for c in [*args.corrections, args.record_correction] if c not in CORRECTIONS]
    if unknown or len(args.seeds) < 2:
        sys.exit(
            f"error: --corrections and --record-correction take {list(CORRECTIONS)} (got {unknown}), --seeds at "
            f"least two"
        )
    results_dir = Path(args.results_dir)
    (results_dir / "runs").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        sargs = staleness_args(args)
        staleness.prepare(sargs, staleness.task)  # loads the prep, or builds it (in --prep-dir only)
        for seed in args.seeds:
            pending = [c for c in args.corrections if not (results_dir / "runs" / f"seed{seed}__{c}.json").exists()]
            if not pending:
                print(f"== seed {seed}: done already")
                continue
            recorded = record(args, sargs, seed)
            for correction in pending:
                replay(
                    args,
                    sargs,
                    seed,
                    correction,
                    recorded,
                    staleness.task,
                    results_dir / "runs" / f"seed{seed}__{correction}.json",
                )
    print("\n".join(report(results_dir, args.quick)))
