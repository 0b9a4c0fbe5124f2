"""Where a staleness run's KL comes from: rerun one run of benchmark/staleness.py, keeping its checkpoints this time,
and split the KL of each evaluation by sample, by token and by problem type.

    python benchmark/kl_breakdown.py benchmark/results/staleness/runs/dpo__sync-1__lr0.0001__seed1.json
    python benchmark/kl_breakdown.py RESULT.json --work-dir W      # W: the --work-dir the staleness run used

The staleness benchmark deletes a run's checkpoints once it has evaluated them. This reruns the command its result file
records (runs are seeded, so the rerun retraces the run: the report compares its KL and gold with the recorded curve)
and evaluates every checkpoint on the same draws as the benchmark. It writes <results>/kl_breakdown/<run>.md beside
the result file's folder. A mean KL of several nats can be a few samples far from the SFT policy or all samples a
little off it; only the spread says which, and the problem types say where.
"""

import json
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tyro

import common
import staleness  # the benchmark's own sampling, encoding and evaluation seeds

REPO = common.REPO
task = staleness.task  # tools/make_arithmetic.py, the gold grader

OPERATIONS = {"giving away": "sub", "getting": "add", "it": "mul"}  # make_arithmetic's worked-solution steps


@dataclass
class Args:
    result_file: tyro.conf.Positional[str]
    """a result file of benchmark/staleness.py (results/staleness/runs/<algorithm>__<setting>__lr<rate>__seed<s>.json)"""
    work_dir: str = str(REPO / "benchmark" / "work" / "staleness")
    """the --work-dir of the staleness sweep that made the result (its prep: data, tokenizer, SFT policy)"""
    rare_probability: float = 1e-3
    """a sampled token is 'rare' when the SFT policy gives it less than this (at the sampling temperature)"""
    top: int = 3
    """samples with the largest log-ratio to print at the final policy"""
    threads: int = 2
    """torch threads for the evaluations (the rerun itself uses the recorded --torch-threads)"""
    force: bool = False
    """rerun even if an earlier rerun's folder holds a finished model"""


def problem_type(answer: str):
    return "+".join(OPERATIONS[step] for step in re.findall(r"After (giving away|getting|it)", answer))


def rerun(result, stem: str, work: Path, force: bool):
    """Run the recorded command again into work/breakdown/<stem>, keeping every checkpoint; returns the folder."""
    folder = work / "breakdown" / stem
    if (folder / "model" / "config.json").exists() and not force:
        print(f"== {stem}: reusing the rerun in {folder}", flush=True)
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    recorded = Path(result["command"][0])  # the script, maybe from another checkout: take this one's
    script = (
        REPO / recorded.parent.name / recorded.name
        if recorded.parent.name == "sync_baselines"
        else REPO / recorded.name
    )
    flags = result["command"][1:]
    flags[flags.index("--output-dir") + 1] = str(folder / "model")
    print(f"== {stem}: rerunning {script.name} into {folder}", flush=True)
    common.run_script([sys.executable, str(script), *flags], folder, f"the rerun of {stem}")
    return folder


def breakdown(policy, sft, tokenizer, eval_set, types, flags, seed: int, rare: float, top: int):
    """The benchmark's evaluation draws (staleness.evaluate_policy's), then the KL per sample, per token and the gold
    per problem type, and the top samples by log-ratio."""
    import torch

    prompts, answers = eval_set
    n, eos = flags["eval_samples"], tokenizer.eos_token_id
    samples = staleness.sample(policy, prompts, n, 0.7, flags["response_length"], eos, 1000 + seed)
    repeated = [p for p in prompts for _ in range(n)]
    pi, ref = (staleness.response_token_logprobs(m, repeated, samples, 0.7, eos) for m in (policy, sft))
    per_sample = torch.tensor([(a - b).sum().item() for a, b in zip(pi, ref)])
    gap, is_rare = torch.cat(pi) - torch.cat(ref), torch.cat(ref) < torch.log(torch.tensor(rare))
    gold = staleness.grade(task, tokenizer, samples, answers, n)
    quantiles = torch.quantile(per_sample, torch.tensor([0.5, 0.9, 0.99])).tolist()
    finals = [task.final_answer(tokenizer.decode(r, skip_special_tokens=True)) for r in samples]
    gold_by_type, kl_by_type, mode_by_type = {}, {}, {}
    for kind in sorted(set(types)):
        rows = [i for i in range(len(samples)) if types[i // n] == kind]
        gold_by_type[kind] = sum(gold[i] for i in rows) / len(rows)
        kl_by_type[kind] = per_sample[rows].mean().item()
        # a collapse onto one answer shows as a single final number taking most samples of a type
        mode, count = Counter(finals[i] for i in rows).most_common(1)[0]
        mode_by_type[kind] = (mode, count / len(rows))
    worst = []
    for i in per_sample.argsort(descending=True)[:top].tolist():
        t = int((pi[i] - ref[i]).argmax())
        worst.append(
            dict(
                log_ratio=per_sample[i].item(),
                text=tokenizer.decode(samples[i], skip_special_tokens=True),
                token=tokenizer.decode([samples[i][t]]),
                p_policy=pi[i][t].exp().item(),
                p_sft=ref[i][t].exp().item(),
            )
        )
    return dict(
        kl=per_sample.mean().item(),
        median=quantiles[0],
        p90=quantiles[1],
        p99=quantiles[2],
        max=per_sample.max().item(),
        rare_tokens=is_rare.float().mean().item(),
        rare_share=(gap[is_rare].sum() / gap.sum()).item() if gap.sum() > 1e-9 else 0.0,
        gold=sum(gold) / len(gold),
        gold_by_type=gold_by_type,
        kl_by_type=kl_by_type,
        mode_by_type=mode_by_type,
        worst=worst,
    )


if __name__ == "__main__":
    args = tyro.cli(Args)
    path, work = Path(args.result_file), Path(args.work_dir)
    if not path.is_file():
        sys.exit(f"error: RESULT_FILE {path} does not exist")
    prep_file = path.parent / "prep.json"
    if not prep_file.is_file() or not (work / "prep.json").is_file():
        sys.exit(
            f"error: need the staleness prep: {prep_file} beside the result file and {work / 'prep.json'} (--work-dir)"
        )
    flags = json.loads(prep_file.read_text())["flags"]
    if json.loads((work / "prep.json").read_text())["flags"] != flags:
        sys.exit(f"error: --work-dir {work} holds another prep than the one {path.name} was made with")
    result = json.loads(path.read_text())

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    folder = rerun(result, path.stem, work, args.force)
    rerun_seconds = time.time() - start
    rerun_note = f"rerun {rerun_seconds:.0f} s" if rerun_seconds > 5 else "an earlier rerun reused"
    n = staleness.setting_flags(result["setting"])[1]
    checkpoints = [(int(c.name.split("_")[1]) * n, c / "policy") for c in (folder / "runs").glob("*/checkpoint_*")]
    points = [(0, work / "sft")] + sorted(checkpoints) + [(result["curve"][-1]["updates"], folder / "model")]
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    test = [json.loads(line) for line in (work / "data" / "test.jsonl").read_text().splitlines()]
    types = [problem_type(p["answer"]) for p in test]
    recorded = {p["updates"]: p for p in result["curve"]}
    rows, diffs = [], []
    for updates, model_dir in points:
        policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        row = breakdown(
            policy,
            sft,
            tokenizer,
            staleness.encode(tokenizer, test),
            types,
            flags,
            result["seed"],
            args.rare_probability,
            args.top,
        )
        rows.append((updates, row))
        diffs += [abs(row["kl"] - recorded[updates]["kl"]), abs(row["gold"] - recorded[updates]["gold_reward"])]
        print(
            f"   update {updates}: KL {row['kl']:.3f} (recorded {recorded[updates]['kl']:.3f}), "
            f"median {row['median']:.3f}, gold {row['gold']:.3f}",
            flush=True,
        )

    kinds = sorted(set(types))
    final_mode = {k: rows[-1][1]["mode_by_type"][k][0] for k in kinds}
    right = {
        k: sum(t == k and p["answer"].split("####")[-1].strip() == final_mode[k] for t, p in zip(types, test))
        / types.count(k)
        for k in kinds
    }  # what always giving the final policy's commonest answer would score
    command = f"python benchmark/kl_breakdown.py {path}"
    lines = [
        f"# KL breakdown: {path.stem}",
        "",
        f"Produced by `{command}` on {time.strftime('%Y-%m-%d %H:%M')} ({rerun_note}, evaluations "
        f"{time.time() - start - rerun_seconds:.0f} s). Each row evaluates one checkpoint of the rerun on the "
        f"staleness benchmark's own draws ({flags['eval_samples']} samples at T = 0.7 per held-out problem). "
        "Per-sample log-ratio = sum over the response of log pi - log pi_sft; the KL is its mean.",
        "",
        f"**The rerun {'retraces' if max(diffs) < 1e-3 else 'does NOT retrace'} the recorded run**: largest "
        f"difference from the recorded curve's KL and gold {max(diffs):.2g}.",
        "",
        "| updates | KL (mean) | recorded KL | median | p90 | p99 | max | rare tokens | their share of the KL | "
        + " | ".join(f"KL: {k}" for k in kinds)
        + " | gold | "
        + " | ".join(f"gold: {k}" for k in kinds)
        + " | "
        + " | ".join(f"commonest answer: {k}" for k in kinds)
        + " |",
        "|" + "---|" * (10 + 3 * len(kinds)),
    ]
    for updates, r in rows:
        lines.append(
            f"| {updates} | {r['kl']:.3f} | {recorded[updates]['kl']:.3f} | {r['median']:.3f} | "
            f"{r['p90']:.3f} | {r['p99']:.3f} | {r['max']:.1f} | {r['rare_tokens']:.4f} | "
            f"{r['rare_share']:.2f} | "
            + " | ".join(f"{r['kl_by_type'][k]:.3f}" for k in kinds)
            + f" | {r['gold']:.3f} | "
            + " | ".join(f"{r['gold_by_type'][k]:.3f}" for k in kinds)
            + " | "
            + " | ".join(f"{r['mode_by_type'][k][0]} ({r['mode_by_type'][k][1]:.0%})" for k in kinds)
            + " |"
        )
    lines += [
        "",
        f"Rare tokens: sampled tokens the SFT policy gives less than {args.rare_probability:g}. "
        "Problem types: the operations of make_arithmetic's worked solution "
        f"({', '.join(f'{k}: {types.count(k)} problems' for k in kinds)}). Commonest answer: the final number "
        "most samples of that type give, and their share; always answering the final policy's commonest one "
        f"would score {', '.join(f'{right[k]:.3f} on {k} ({final_mode[k]})' for k in kinds)}.",
        "",
        f"The {args.top} samples with the largest log-ratio at the final policy, with their most unlikely token "
        "under SFT relative to the policy:",
        "",
    ]
    for w in rows[-1][1]["worst"]:
        lines.append(
            f"- log-ratio {w['log_ratio']:.1f}, token {w['token']!r} (policy {w['p_policy']:.3g}, SFT "
            f"{w['p_sft']:.2g}): {w['text']!r}"
        )
    out = path.parent.parent / "kl_breakdown" / f"{path.stem}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
