"""Issue 67: DPO recalibrated for the staleness sweep. At the sweep's beta 0.1 DPO's sync-1 over-optimises and has no
gain to keep, so the sweep could not test the paper's claim for it. DPO_RULE, committed with this file before any of
its runs, picks a beta on sync-1 alone, then runs DPO's sync-N at that beta on the sweep's own prep and judges it
against the sweep's RLOO and PPO runs, reused unchanged.

    python benchmark/staleness_dpo.py --time-budget-hours 8   # resumable; a second invocation at once shares the runs
    python benchmark/staleness_dpo.py --report-only           # rebuild staleness_dpo.md / .png from the result files

Each run is staleness_paper.run_one on the sweep's miniature with `--beta` overridden; it refuses to start on another
prep than the one recorded in staleness_sweep/prep.json.
"""

import json
import math
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tyro

import common
import staleness as base  # the budgets
import staleness_paper as paper  # the runs, the evaluation and the statistics
import staleness_sweep as sweep  # the miniature, its prep check, final and gain, the plot

NAME = "staleness_dpo"
BETAS = (0.3, 0.5, 1.0)  # the calibration's, smallest first: the sweep's 0.1 over-optimises
CALIBRATION_SEEDS = (1, 2, 3)
PEAK_TOLERANCE, MIN_GAIN, MAX_FINAL_KL = 0.01, 0.05, 4.0
DPO_SYNC_N = (1, 16, 64, 128)
STALE_N = 128  # the primary test's N
SEEDS = sweep.SWEEP_SEEDS
DPO_RULE = (
    "**DPO recalibrated, fixed before its first run** (issue 67; DPO_RULE was committed with "
    "benchmark/staleness_dpo.py, and stands in this header, before any of its runs). The pre-registered sweep could "
    "not test the paper's claim for DPO: at beta 0.1 its sync-1 over-optimises (gold peaks at update 64-192 and falls "
    "while the proxy rises) and has no gain to keep. RLOO's and PPO's 80 runs of the sweep are reused unchanged; DPO "
    "alone is recalibrated, by its own knob `--beta`, on the same prep (the SFT and RM weights whose sha256 "
    "staleness_sweep/prep.json records, checked before any run) at the shared learning rate 1e-4; everything else is "
    f"the sweep's DPO run (gate `{sweep.GATE}`).\n"
    "- *Win-rate*: the gold win-rate against the SFT policy's reference samples (every policy sample of a held-out "
    "problem against every SFT sample of it, a tie counting half), so 0.5 is parity with the SFT policy in "
    "expectation; the reference samples are one fixed draw, against which the SFT policy itself (each run's update-0 "
    "evaluation, on the run's own draws) reads 0.504-0.521 in the sweep, so a dip below 0.5 is measured from parity, "
    "not from the run's start. Per run: *final* = the mean "
    f"of the evaluations at updates {' and '.join(map(str, sweep.FINAL_UPDATES))} (the sweep's); *peak* = the largest "
    "win-rate over its evaluations; *gain* = final minus its update-0 win-rate; *final KL* = KL(pi || pi_sft) at the "
    "last evaluation.\n"
    f"- **1. Calibration**, on sync-1 alone: beta in {{{', '.join(map(str, BETAS))}}} x seeds "
    f"{CALIBRATION_SEEDS[0]}-{CALIBRATION_SEEDS[-1]} (9 runs, seed-major). A beta *qualifies* when all 3 seeds end "
    f"within {PEAK_TOLERANCE} of their own peak (peak - final <= {PEAK_TOLERANCE}), their mean gain is >= "
    f"+{MIN_GAIN} and their mean final KL <= {MAX_FINAL_KL:g}. The smallest qualifying beta is chosen; if none "
    "qualifies, nothing more is run.\n"
    f"- **2. The sweep** at the chosen beta: DPO sync-N for N in {{{', '.join(map(str, DPO_SYNC_N))}}} x seeds "
    f"{SEEDS[0]}-{SEEDS[-1]} (the calibration's 3 sync-1 runs at that beta are those seeds' sync-1 runs: 29 new "
    "runs), against the sweep's RLOO and PPO runs.\n"
    f"- **3. The primary test**, the one test of the claim: each seed's *drop* at N = {STALE_N} (sync-1's final "
    f"minus sync-{STALE_N}'s, paired by seed), every run counted (escaped runs included: escaping is part of "
    "staleness's cost), DPO against PPO and DPO against RLOO, Welch's t two-sided, Holm over the 2. Beside it, not a "
    f"second verdict: the *escapes* at N = {STALE_N} (a run whose largest KL exceeds twice the largest KL of its "
    "algorithm's sync-1 runs, the sweep's definition), DPO against each by Fisher's exact test, Holm over the 2.\n"
    "- *Secondary*, declared as such (Welch's t, DPO against each, Holm over the 2 within each, every run counted): "
    f"(a) each seed's mean drop over N in {{{', '.join(map(str, sweep.RANKED_N))}}}; (b) the drop at update "
    f"{STALE_N}, sync-1's evaluation there minus sync-{STALE_N}'s (paired by seed: the cost of the first stale round, "
    f"before any refresh); (c) the deepest dip below the SFT policy of each sync-{STALE_N} run, the minimum over its "
    "evaluations of win-rate minus 0.5.\n"
    f"- **Known before these runs**: in the sweep RLOO loses nothing measurable at N = {STALE_N} (drop "
    '-0.007 ± 0.010 over its 8 runs), so against RLOO "DPO more robust" can at best read *not distinguishable*; '
    "PPO there pays +0.034 ± 0.014 (all 8 runs, 4 of them escaped).\n"
    "- **How it reads**, per pair, once every run exists: *supported* when DPO's mean drop is the smaller, its Holm "
    "p < 0.05 and the other algorithm pays (its mean drop > 0): DPO keeps more of a gain the other loses. *Not "
    "supported* otherwise: *not distinguishable* when Holm p >= 0.05 or the other pays nothing, *DPO pays more* when "
    "DPO's mean drop is the larger with Holm p < 0.05. *Undetermined* when no beta qualifies: DPO has no gain to keep "
    "on this prep at any beta tried, and the claim stays untested for it."
)


@dataclass
class Args:
    results_dir: str = sweep.Args.results_dir
    """where staleness_dpo/ (one file per run), staleness_dpo.md and its plot go; staleness_sweep/ is read from here"""
    work_dir: str = sweep.Args.work_dir
    """the sweep's prep folder (its SFT policy and RM; the run folders and claims go under runs/staleness_dpo/)"""
    scripts_dir: str = sweep.Args.scripts_dir
    """folder holding the scripts the runs execute (a frozen copy keeps the runs off a work tree being edited)"""
    time_budget_hours: Optional[float] = None
    """do not start a run that would likely end after this many hours of this invocation (None: no limit)"""
    report_only: bool = False
    """only rebuild the report and the plot from the result files"""


def calibration_runs():
    """(beta, N, seed), seed-major: seed 1 of every beta first, so a partial calibration is informative."""
    return [(beta, 1, seed) for seed in CALIBRATION_SEEDS for beta in BETAS]


def sweep_runs(beta: float):
    """(beta, N, seed) of the chosen beta's sweep, seed-major (its calibration runs are skipped as they exist)."""
    return [(beta, n, seed) for seed in SEEDS for n in DPO_SYNC_N]


def result_file(results_dir: Path, beta: float, n: int, seed: int):
    return results_dir / NAME / f"dpo__sync-{n}__lr{paper.LEARNING_RATE:g}__beta{beta:g}__seed{seed}.json"


def run(args: Args):
    """The calibration, the choice by DPO_RULE, then the chosen beta's sweep; existing runs are skipped, a run
    another invocation holds is left to it (and waited for where the choice needs it)."""
    run_args = sweep.paper_args(
        sweep.Args(
            algorithms=["dpo"],
            results_dir=args.results_dir,
            work_dir=args.work_dir,
            scripts_dir=args.scripts_dir,
            time_budget_hours=args.time_budget_hours,
        )
    )
    prep = sweep_prep(args, run_args)
    start, durations = time.time(), []

    def go(plan):  # False when the time budget stops this invocation
        for beta, n, seed in plan:
            path = result_file(Path(args.results_dir), beta, n, seed)
            if path.exists():
                common.check_same_budget(path, base.budget(run_args, f"sync-{n}"))
                continue
            if not paper.may_start(run_args, path, start, durations, len(durations)):
                return False
            claimed = common.claim(Path(args.work_dir), f"{NAME}/{path.stem}")
            if claimed is None:
                print(f"== {path.stem}: being run by another invocation, skipped", flush=True)
                continue
            try:
                miniature = paper.gate_miniature(run_args, prep, sweep.GATE, "dpo")[1]
                miniature["overrides"], miniature["extra"]["beta"] = {"--beta": f"{beta:g}"}, beta
                lr = run_args.learning_rates[0]
                durations.append(paper.run_one(run_args, prep, "dpo", f"sync-{n}", lr, seed, path, **miniature))
            finally:
                claimed.unlink(missing_ok=True)
        return True

    while True:
        if not go(calibration_runs()):
            return
        status, beta = choose(calibration(load(Path(args.results_dir))))
        if status != "pending":
            break
        if args.time_budget_hours is not None and time.time() - start > 3600 * args.time_budget_hours:
            return
        print("== the choice waits for a calibration run another invocation holds", flush=True)
        time.sleep(60)
    print(f"== DPO_RULE's calibration: {status}" + (f", beta {beta:g}" if beta else ""), flush=True)
    if beta is not None:
        go(sweep_runs(beta))


def sweep_prep(args: Args, run_args):
    """The sweep's prep, loaded (never built here) and checked against staleness_sweep/prep.json and its runs."""
    if not (Path(args.work_dir) / "prep_paper.json").exists():
        sys.exit(f"error: no prep in {args.work_dir}: these runs need the sweep's (--work-dir), never a new one")
    recorded = Path(args.results_dir) / sweep.SWEEP_NAME
    if not (recorded / "prep.json").exists():
        sys.exit(f"error: no {recorded / 'prep.json'}: the sweep's prep, which these runs must share, is unknown")
    prep = paper.prepare(run_args)
    prep["prep_sha256"] = sweep.prep_fingerprint(Path(args.work_dir))
    sweep.check_same_prep(recorded, prep)
    return prep


# THE REPORT: DPO_RULE's numbers, from the result files alone
def load(results_dir: Path):
    """{beta: {N: {seed: run}}} of this folder's runs."""
    runs = defaultdict(lambda: defaultdict(dict))
    for path in sorted((results_dir / NAME).glob("dpo__sync-*__beta*__seed*.json")):
        r = json.loads(path.read_text())
        runs[r["beta"]][int(r["setting"].split("-")[1])][r["seed"]] = r
    return runs


def calibration(runs):
    """Per beta: each calibration seed's final, peak, gain and final KL, and whether the beta qualifies (None while
    one of its runs is missing)."""
    found = {}
    for beta in BETAS:
        rs = [runs[beta][1][s] for s in CALIBRATION_SEEDS if s in runs.get(beta, {}).get(1, {})]
        seeds = [
            dict(
                seed=r["seed"],
                final=sweep.final(r),
                peak=max(p["win_rate"] for p in r["curve"]),
                gain=sweep.gain(r),
                kl=r["curve"][-1]["kl"],
            )
            for r in rs
        ]
        mean = lambda key: sum(x[key] for x in seeds) / len(seeds) if seeds else float("nan")
        qualifies = (
            all(x["peak"] - x["final"] <= PEAK_TOLERANCE for x in seeds)
            and mean("gain") >= MIN_GAIN
            and mean("kl") <= MAX_FINAL_KL
        )
        found[beta] = dict(seeds=seeds, gain=mean("gain"), kl=mean("kl"), qualifies=qualifies if len(rs) == 3 else None)
    return found


def choose(found):
    """DPO_RULE's choice: ("chosen", the smallest qualifying beta), ("undetermined", None) when none qualifies, or
    ("pending", None) while a smaller beta's runs are missing."""
    for beta in BETAS:
        if found[beta]["qualifies"] is None:
            return "pending", None
        if found[beta]["qualifies"]:
            return "chosen", beta
    return "undetermined", None


def at(run, updates: int):
    return next(p["win_rate"] for p in run["curve"] if round(p["updates"]) == updates)


def drops(by_n, n: int, value=sweep.final):
    """Each seed's value of sync-1 minus sync-N's (paired by seed), every run counted."""
    return {s: value(by_n[1][s]) - value(r) for s, r in by_n.get(n, {}).items() if s in by_n.get(1, {})}


def measures(by_n):
    """An algorithm's per-seed values of the primary test and the secondary views (DPO_RULE), and its escapes at
    STALE_N: (escaped, runs)."""
    per_n = {n: drops(by_n, n) for n in sweep.RANKED_N}
    both = set.intersection(*map(set, per_n.values()))
    bound = 2 * max(paper.reach(r["curve"]) for r in by_n[1].values())
    stale = by_n.get(STALE_N, {})
    return dict(
        primary=list(drops(by_n, STALE_N).values()),
        ranked=[sum(per_n[n][s] for n in sweep.RANKED_N) / len(per_n) for s in sorted(both)],
        first_round=list(drops(by_n, STALE_N, lambda r: at(r, STALE_N)).values()),
        dip=[min(p["win_rate"] for p in r["curve"]) - 0.5 for r in stale.values()],
        escapes=(sum(paper.reach(r["curve"]) > bound for r in stale.values()), len(stale)),
    )


SECONDARY = {  # DPO_RULE's secondary views, as the report names them
    "ranked": f"(a) mean drop over N in {{{', '.join(map(str, sweep.RANKED_N))}}}",
    "first_round": f"(b) drop at update {STALE_N}, N = {STALE_N}",
    "dip": f"(c) deepest dip below 0.5 (min win-rate - 0.5), N = {STALE_N}",
}


def compare(found, key: str):
    """DPO against PPO and against RLOO on one measure: the means, Welch's p and Holm's over the 2."""
    others = [o for o in ("ppo", "rloo") if "dpo" in found and o in found]
    welch = [paper.welch(found["dpo"][key], found[o][key])[2] for o in others]
    mean = lambda v: sum(v) / len(v) if v else float("nan")
    return [
        dict(other=o, dpo=mean(found["dpo"][key]), theirs=mean(found[o][key]), p=p, holm=h)
        for o, p, h in zip(others, welch, paper.holm(welch))
    ]


def reading(row):
    """DPO_RULE's reading of the primary test for one pair."""
    if not row["holm"] < 0.05:
        return "not supported: not distinguishable"
    if row["dpo"] < row["theirs"]:
        return "**supported**" if row["theirs"] > 0 else "not supported: not distinguishable (the other pays nothing)"
    return "not supported: DPO pays more"


def judge(runs, sweep_runs_):
    """DPO_RULE's choice, and then each algorithm's runs by N and seed (DPO's at the chosen beta; {} before)."""
    status, beta = choose(calibration(runs))
    if beta is None:
        return status, beta, {}
    by_algo = {"dpo": runs[beta]}
    for algo in ("ppo", "rloo"):
        by_n = {n: {r["seed"]: r for r in sweep_runs_.get((algo, f"sync-{n}"), [])} for n in DPO_SYNC_N}
        if by_n[1]:
            by_algo[algo] = by_n
    return status, beta, by_algo


def report(results_dir: Path):
    """staleness_dpo.md and staleness_dpo.png, judged by DPO_RULE."""
    runs = load(results_dir)
    sweep_runs_ = paper.load_results(results_dir, sweep.SWEEP_NAME, paper.LEARNING_RATE)[0]
    ci = lambda v: "{:+.3f} ± {:.3f}".format(*paper.mean_ci(v)) if len(v) > 1 else (f"{v[0]:+.3f}" if v else "–")
    pv = lambda p: "–" if math.isnan(p) else "<0.001" if p < 0.001 else f"{p:.3f}"
    cal = calibration(runs)
    lines = [
        "Issue 67: DPO recalibrated for the staleness sweep, on the sweep's prep, against its RLOO and PPO runs "
        "(staleness_sweep.md).",
        f"Produced by `python benchmark/staleness_dpo.py --report-only` from the result files in `{NAME}/` and "
        f"`{sweep.SWEEP_NAME}/`; every ± is a 95% CI over seeds (Student's t).",
        "",
        DPO_RULE,
        "",
        f"Calibration: {sum(len(c['seeds']) for c in cal.values())} of {len(calibration_runs())} runs.",
        "",
        "| beta | seed | final | peak | peak - final | gain | final KL | qualifies |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for beta, c in cal.items():
        for x in c["seeds"]:
            lines.append(
                f"| {beta:g} | {x['seed']} | {x['final']:.3f} | {x['peak']:.3f} | {x['peak'] - x['final']:.3f} | "
                f"{x['gain']:+.3f} | {x['kl']:.2f} | {'yes' if x['peak'] - x['final'] <= PEAK_TOLERANCE else 'no'} |"
            )
        verdict = {None: "pending", True: "**yes**", False: "no"}[c["qualifies"]]
        mean = f"{c['gain']:+.3f} | {c['kl']:.2f}" if c["seeds"] else "– | –"
        lines.append(f"| {beta:g} | mean | | | | {mean} | {verdict} |")
    status, beta, by_algo = judge(runs, sweep_runs_)
    choice = {
        "pending": "pending (a calibration run is missing)",
        "undetermined": "**undetermined**: no beta qualifies; DPO has no gain to keep on this prep, nothing more is run",
        "chosen": f"beta = {beta:g}" if beta else "",
    }[status]
    lines += ["", f"DPO_RULE's choice: {choice}."]
    if by_algo:
        found = {algo: measures(by_n) for algo, by_n in by_algo.items()}
        done = sum(len(runs[beta].get(n, {})) for n in DPO_SYNC_N)
        planned = len(sweep_runs(beta))
        lines += [
            "",
            "| algorithm | N | runs | drop below sync-1 (every run) | gain | final KL |",
            "|---|---|---|---|---|---|",
        ]
        for algo, by_n in by_algo.items():
            for n in DPO_SYNC_N:
                rs = list(by_n.get(n, {}).values())
                lines.append(
                    f"| {algo}{f' (beta {beta:g})' if algo == 'dpo' else ''} | {n} | {len(rs)} | "
                    f"{'–' if n == 1 else ci(list(drops(by_n, n).values()))} | {ci([sweep.gain(r) for r in rs])} | "
                    f"{ci([r['curve'][-1]['kl'] for r in rs])} |"
                )
        primary, complete = compare(found, "primary"), done == planned
        fisher = [paper.fisher_exact(*found["dpo"]["escapes"], *found[r["other"]]["escapes"]) for r in primary]
        lines += [
            "",
            f"The primary test: each seed's drop at N = {STALE_N}, every run counted.",
            "",
            "| pair | DPO's mean drop | the other's | Welch p | Holm p | escapes (DPO, other) | Fisher p | Holm p | "
            "reading |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r, f, fh in zip(primary, fisher, paper.holm(fisher)):
            (ea, na), (eb, nb) = found["dpo"]["escapes"], found[r["other"]]["escapes"]
            lines.append(
                f"| dpo vs {r['other']} | {r['dpo']:+.3f} | {r['theirs']:+.3f} | {pv(r['p'])} | {pv(r['holm'])} | "
                f"{ea} of {na}, {eb} of {nb} | {pv(f)} | {pv(fh)} | {reading(r) if complete else 'pending'} |"
            )
        lines += ["", "Secondary views (declared as such, no verdict).", ""]
        lines += ["| measure | pair | DPO | the other | Welch p | Holm p |", "|---|---|---|---|---|---|"]
        for key, what in SECONDARY.items():
            for r in compare(found, key):
                lines.append(
                    f"| {what} | dpo vs {r['other']} | {r['dpo']:+.3f} | {r['theirs']:+.3f} | {pv(r['p'])} | "
                    f"{pv(r['holm'])} |"
                )
        state = "complete" if complete else "not complete"
        read = "the readings above are DPO_RULE's" if complete else "no verdict is read from it yet"
        lines += ["", f"The DPO sweep at beta {beta:g} is {state} ({done} of {planned} runs): {read}."]
        plot(runs[beta], sweep_runs_, results_dir)
    (results_dir / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    return lines


def plot(dpo_by_n, sweep_runs_, results_dir: Path):
    """staleness_dpo.png: staleness_sweep.plot (the paper's Fig. 4) with DPO's panel at the chosen beta."""
    runs = {k: v for k, v in sweep_runs_.items() if k[0] != "dpo"}
    runs.update({("dpo", f"sync-{n}"): list(rs.values()) for n, rs in dpo_by_n.items()})
    with tempfile.TemporaryDirectory() as tmp:
        sweep.plot(runs, sweep.verdicts(runs), Path(tmp))
        shutil.move(Path(tmp) / f"{sweep.SWEEP_NAME}.png", results_dir / f"{NAME}.png")


if __name__ == "__main__":
    args = tyro.cli(Args)
    (Path(args.results_dir) / NAME).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run(args)
    print("\n".join(report(Path(args.results_dir))))
