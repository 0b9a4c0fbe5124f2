"""Staleness the paper's way: a proxy reward model over a continuous gold, gold win-rate against KL, one learning rate.
Noukhovitch et al. (2025), Sec. 3, in miniature on this machine.

    python benchmark/staleness_paper.py --prep-only                 # data, SFT policy, gold-labelled pairs, proxy RM
    python benchmark/staleness_paper.py --settings sync-1 --seeds 1 --learning-rates 1e-4 3e-4   # the gate runs
    python benchmark/staleness_paper.py --time-budget-hours 2       # the sweep, until 2 h are used; rerun to go on
    python benchmark/staleness_paper.py --report-only               # rebuild staleness_paper/first.md / .png
    python benchmark/staleness_paper.py --gate rm-e1__u512__kl0.01 --time-budget-hours 2  # issue 41's sweep on a gate
    python benchmark/staleness_paper.py --quick --algorithms dpo --results-dir D --work-dir W   # the tests' smoke run

The paper's protocol, and what stands for each part of it here:
  task     one-step arithmetic word problems (tools/make_arithmetic.py), the SFT policy of benchmark/staleness.py
           (a 0.4M-parameter Llama stopped at ~0.2 greedy accuracy), built by the same code
  gold     `make_arithmetic.gold_score`: continuous, 0.8 / (1 + |answer error|) + 0.2 for the taught "#### n" ending;
           stands for the paper's 6.9B gold reward model
  proxy    a policy-sized reward model (the SFT weights plus a scalar head) trained with Bradley-Terry on pairs of SFT
           samples labelled by the gold (as the paper's RM was trained on gold-labelled pairs); every RL run optimises
           it through the scripts' own `--reward model` path, so gold can peak and fall while the proxy rises
  samples  per prompt: DPO 2 (one pair), RLOO 2, PPO 1, as in the paper's TL;DR runs; one learning rate for all
  N, K     sync-N: N mini-batches per generation round (N-1 of every N updates off-policy), the mini-batch and number of
           updates fixed; async-K: each batch made K policy versions ago, under `paper` and `behaviour`
  metric   gold win-rate against the SFT policy (each policy sample against each SFT sample of the same held-out
           prompt, ties half) versus KL to the SFT policy; first the paper's measure (its Fig. 4: where the final point
           lands), the final win-rate's drop below sync-1's, then the mean shortfall of the curve below sync-1's over
           the KL range every run of the algorithm reaches; both paired by seed, "separated" only under a Holm
           correction over the family of tests
GRPO trains on a verifier and has no proxy: it is not in this protocol. Every run is one subprocess of the real script;
a run writes one result file, a rerun skips it, so the sweep spans sessions.
"""

import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import tyro

import common
import staleness as base  # the prep it extends (data, tokenizer, SFT), the sampler, the KL and the budgets

REPO = common.REPO
task = common.arithmetic_task()  # problems, the binary grader (SFT stopping rule) and the continuous gold

# One rate for every algorithm, as in the paper: chosen by the gate runs on sync-1 (docs/benchmarks.md)
LEARNING_RATE = 1e-4
ALGORITHMS = {
    "dpo": dict(
        async_script="async_dpo.py",
        sync_script="sync_baselines/sync_dpo.py",
        corrections=False,
        flags=["--num-samples-per-prompt", "2", "--beta", "0.1"],
    ),
    "rloo": dict(
        async_script="async_rloo.py",
        sync_script="sync_baselines/sync_rloo.py",
        corrections=True,
        flags=["--num-samples-per-prompt", "2", "--kl-coef", "0.05"],
    ),
    "ppo": dict(
        async_script="async_ppo.py",
        sync_script="sync_baselines/sync_ppo.py",
        corrections=True,
        flags=["--num-samples-per-prompt", "1", "--kl-coef", "0.05"],
    ),
}
COMMON_FLAGS = [
    "--model-name-or-path",
    "{sft}",
    "--reward",
    "model",
    "--reward-model-path",
    "{rm}",
    "--dataset-path",
    "{prompts}",
    "--missing-eos-penalty",
    "{penalty}",
    "--max-prompt-tokens",
    "96",
    "--temperature",
    "0.7",
    "--torch-threads",
    "1",
    "--sample-every",
    "1000000",
    "--keep-checkpoints",
    "0",
]
SYNC_N = (1, 4, 16, 32)
# issue 41's sweep on a gate candidate's miniature (--gate): the paper's N (Fig. 4: 1-16) and 32; a superset of SYNC_N,
# so the report lists every sweep's settings in this order
GATE_SYNC_N = (1, 2, 4, 8, 16, 32)
ASYNC_K = (1, 4, 8)
CORRECTIONS = ("paper", "behaviour")
QUICK_SETTINGS = ["sync-1", "sync-2", "async-1", "async-1-paper"]
# the settings whose scores rank the algorithms: the most off-policy of each kind, async under the paper's own loss
RANKED = ("sync-16", "sync-32", "async-4", "async-8")
KL_GRID = 20  # points of the common KL range at which curves are compared


def settings_of(algo: str, sync_n=SYNC_N):
    """sync-N for each N of sync_n, then async-K (DPO) or async-K-<correction>, in table order."""
    if ALGORITHMS[algo]["corrections"]:
        return [f"sync-{n}" for n in sync_n] + [f"async-{k}-{c}" for c in CORRECTIONS for k in ASYNC_K]
    return [f"sync-{n}" for n in sync_n] + [f"async-{k}" for k in ASYNC_K]


def sweep_of(gate: Optional[str]):
    """The first sweep, or the sweep on gate candidate `gate`'s miniature (--gate): the name of its result folder,
    report and plots (a path under --results-dir: <name>/ holds the runs, <name>.md the report), its N, and the one
    learning rate its report reads."""
    if gate is None:
        return "staleness_paper/first", SYNC_N, LEARNING_RATE
    return f"staleness_paper/{gate}", GATE_SYNC_N, GATE_CANDIDATES[gate]["lr"]


@dataclass
class Args:
    algorithms: List[str] = field(default_factory=lambda: list(ALGORITHMS))
    """algorithms to run"""
    settings: Optional[List[str]] = None
    """settings to run (None: all of each algorithm): sync-N, async-K (DPO), async-K-<paper|behaviour>"""
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """seeds of the RL runs (the prep is seeded separately and shared)"""
    learning_rates: List[float] = field(default_factory=lambda: [LEARNING_RATE])
    """learning rates to run; runs at other rates than LEARNING_RATE are the gate's and stay out of the ranking"""
    mini_batch_prompts: int = 16
    """prompts per optimizer update, the same for every setting (a generation round of sync-N holds N mini-batches)"""
    num_updates: int = 256
    """optimizer updates per run, the same for every setting; must be divisible by every N"""
    eval_every_updates: int = 32
    """evaluate the policy every this many updates (a multiple of every N), so each run is a curve"""
    response_length: int = 48
    """maximum new tokens per response"""
    difficulty: int = 1
    """arithmetic difficulty (operations per problem)"""
    num_train_problems: int = 4096
    """generated training problems (SFT, reward-model pairs and RL prompts)"""
    num_eval_problems: int = 256
    """held-out problems for every evaluation"""
    sft_max_steps: int = 3000
    """SFT optimizer steps at most (batch 32)"""
    sft_target_accuracy: float = 0.2
    """SFT stops at the first check whose greedy held-out accuracy reaches this"""
    eval_samples: int = 4
    """samples per held-out problem (temperature 0.7), for the policy and for the SFT reference it is compared with"""
    rm_samples: int = 4
    """SFT samples per training problem for the reward model's pairs (disjoint pairs: rm_samples / 2 per problem)"""
    rm_epochs: int = 2
    """Bradley-Terry epochs over the pairs"""
    rm_learning_rate: float = 3e-4
    """AdamW learning rate of the reward model, decayed linearly to 0"""
    prep_threads: int = 2
    """torch threads for the prep and the evaluations (the RL runs use --torch-threads 1 per role)"""
    results_dir: str = str(REPO / "benchmark" / "results")
    """where result files go: the sweep's under staleness_paper/ (first/ and first.md with its plots, or the gate's)"""
    work_dir: str = str(REPO / "benchmark" / "work" / "staleness_paper")
    """scratch space (git-ignored): data, tokenizer, SFT policy, reward model, run folders"""
    max_runs: Optional[int] = None
    """stop after this many new runs (None: no limit)"""
    time_budget_hours: Optional[float] = None
    """do not start a run that would likely end after this many hours of this invocation (None: no limit)"""
    quick: bool = False
    """smoke mode for the test suite: tiny prep, 4 updates, 1 seed, settings sync-1, sync-2, async-1(-paper)"""
    prep_only: bool = False
    """build (or load) the prep and stop"""
    report_only: bool = False
    """only rebuild the report (staleness_paper/first.md, or the --gate one) and its plots from existing
    result files"""
    force: bool = False
    """rerun runs whose result file exists"""
    scripts_dir: str = str(REPO)
    """folder holding the scripts the runs execute (a frozen copy keeps a long sweep off a work tree being edited)"""
    gate: Optional[str] = None
    """issue 41's sweep on this GATE_CANDIDATES key's miniature (its proxy, updates, evaluation period, learning rate
    and --kl-coef / --beta), sync-N over GATE_SYNC_N; results in staleness_paper/<gate>/, report
    staleness_paper/<gate>.md"""


# GOLD, WIN-RATE AND THE PROXY REWARD MODEL
def gold_scores(tokenizer, responses, answers, n):
    """The continuous gold of each response (prompt-major, n per prompt)."""
    return [
        task.gold_score(tokenizer.decode(r, skip_special_tokens=True), answers[i // n]) for i, r in enumerate(responses)
    ]


def win_rate(policy_gold, reference_gold, n, m):
    """Gold win-rate of the policy against the SFT policy: every one of a prompt's n policy samples against every one of
    its m SFT samples, a tie counting half (the paper's win-rate, with the judge replaced by the gold score)."""
    wins = 0.0
    for i in range(len(policy_gold) // n):
        for a in policy_gold[i * n : (i + 1) * n]:
            wins += sum(1.0 if a > b else 0.5 if a == b else 0.0 for b in reference_gold[i * m : (i + 1) * m])
    return wins / (len(policy_gold) * m)


def rm_scores(rm, prompts, responses, pad_id, chunk=64):
    """Score at each sequence's last real token (its EOS when it has one), as the scripts' `get_scores` reads it."""
    import torch

    out = []
    for s in range(0, len(prompts), chunk):
        ids, mask = base.pad_right([p + r for p, r in zip(prompts[s : s + chunk], responses[s : s + chunk])], pad_id)
        hidden = getattr(rm, rm.base_model_prefix)(input_ids=ids, attention_mask=mask).last_hidden_state
        out.append(rm.score(hidden[torch.arange(len(ids)), mask.sum(1) - 1]).squeeze(-1).float())
    return torch.cat(out)


def proxy_rewards(rm, prompts, responses, eos_id, penalty, pad_id):
    """What an RL run is trained on: the reward model's score, or the missing-EOS penalty for a response without EOS
    (the scripts' `--missing-eos-penalty`)."""
    import torch

    with torch.no_grad():
        scores = rm_scores(rm, prompts, responses, pad_id)
    return [s if r and r[-1] == eos_id else penalty for s, r in zip(scores.tolist(), responses)]


def train_reward_model(
    args: Args,
    tokenizer,
    train_set,
    eval_set,
    sft_dir: Path,
    out_dir: Path,
    log,
):
    """Bradley-Terry on gold-labelled pairs of the SFT policy's own samples (disjoint pairs of rm_samples per training
    problem; tied pairs carry no preference and are dropped). Starts from the SFT weights with a new scalar head, as
    the paper's RM starts from its SFT model. Its score is then scaled to unit variance on SFT samples of held-out
    problems, so the KL coefficient weighs the same reward scale in every run, and the missing-EOS penalty is set two
    standard deviations below their mean."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

    sft = AutoModelForCausalLM.from_pretrained(sft_dir).eval()
    n, eos, pad = args.rm_samples, tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts, answers = train_set
    responses = base.sample(sft, prompts, n, 0.7, args.response_length, eos, seed=1)
    gold = gold_scores(tokenizer, responses, answers, n)
    pairs = []
    for i in range(0, len(responses) - 1, 2):
        if gold[i] != gold[i + 1]:
            better, worse = (i, i + 1) if gold[i] > gold[i + 1] else (i + 1, i)
            pairs.append((prompts[i // n], responses[better], responses[worse]))
    split = len(pairs) * 9 // 10  # the last tenth (the last problems) tests the RM on pairs it never saw
    train_pairs, test_pairs = pairs[:split], pairs[split:]
    log(f"RM: {len(pairs)} gold-labelled pairs of {len(responses) // 2} ({len(responses) // 2 - len(pairs)} tied)")
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification.from_pretrained(sft_dir, num_labels=1)
    optimizer = torch.optim.AdamW(rm.parameters(), lr=args.rm_learning_rate, weight_decay=0.0)
    rng, batch_size = random.Random(0), 32
    total = args.rm_epochs * math.ceil(len(train_pairs) / batch_size)
    update = 0
    for epoch in range(args.rm_epochs):
        rng.shuffle(train_pairs)
        for s in range(0, len(train_pairs), batch_size):
            batch = train_pairs[s : s + batch_size]
            for g in optimizer.param_groups:
                g["lr"] = args.rm_learning_rate * (1 - update / total)
            scores = rm_scores(rm, [b[0] for b in batch] * 2, [b[1] for b in batch] + [b[2] for b in batch], pad)
            loss = -torch.nn.functional.logsigmoid(scores[: len(batch)] - scores[len(batch) :]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            update += 1
        log(f"RM epoch {epoch + 1}: last loss {loss.item():.3f}")
    rm.eval()
    with torch.no_grad():
        chosen = rm_scores(rm, [b[0] for b in test_pairs], [b[1] for b in test_pairs], pad)
        rejected = rm_scores(rm, [b[0] for b in test_pairs], [b[2] for b in test_pairs], pad)
        # unit variance on SFT samples of held-out problems (the head has no bias, so only the scale is set)
        reference, held_out_gold = eval_set["sft_samples"], eval_set["sft_gold"]
        repeated = [p for p in eval_set["prompts"] for _ in range(args.eval_samples)]
        scores = rm_scores(rm, repeated, reference, pad)
        rm.score.weight.mul_(1.0 / scores.std().item())
        scores = scores / scores.std()
    rm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    penalty = round(scores.mean().item() - 2.0, 2)
    gold_t = torch.tensor(held_out_gold)
    return dict(
        rm_pairs=len(pairs),
        rm_tied_pairs=len(responses) // 2 - len(pairs),
        rm_train_pairs=len(train_pairs),
        rm_test_pair_accuracy=(chosen > rejected).float().mean().item(),
        rm_gold_correlation=torch.corrcoef(torch.stack([scores, gold_t]))[0, 1].item(),
        rm_score_mean=scores.mean().item(),
        missing_eos_penalty=penalty,
        rm_parameters=sum(p.numel() for p in rm.parameters()),
    )


def evaluate(policy, sft, rm, tokenizer, eval_set, prep, args: Args, seed: int):
    """Gold, gold win-rate against the SFT samples, proxy reward and KL(pi || pi_sft) of T=0.7 samples of the held-out
    problems."""
    prompts, answers, n, eos = eval_set["prompts"], eval_set["answers"], args.eval_samples, tokenizer.eos_token_id
    samples = base.sample(policy, prompts, n, 0.7, args.response_length, eos, seed)
    repeated = [p for p in prompts for _ in range(n)]
    kls = [
        a - b
        for a, b in zip(
            base.response_logprob_sums(policy, repeated, samples, 0.7, eos),
            base.response_logprob_sums(sft, repeated, samples, 0.7, eos),
        )
    ]
    gold = gold_scores(tokenizer, samples, answers, n)
    proxy = proxy_rewards(rm, repeated, samples, eos, prep["missing_eos_penalty"], tokenizer.pad_token_id)
    return dict(
        win_rate=win_rate(gold, eval_set["sft_gold"], n, n),
        gold=sum(gold) / len(gold),
        proxy=sum(proxy) / len(proxy),
        kl=sum(kls) / len(kls),
        exact=sum(g == 1.0 for g in gold) / len(gold),
        eos_rate=sum(eos in s for s in samples) / len(samples),
        response_length=sum(map(len, samples)) / len(samples),
    )


# PREP: the shared SFT prep of benchmark/staleness.py, then the SFT reference samples and the proxy reward model
PREP_FLAGS = base.PREP_FLAGS + ("rm_samples", "rm_epochs", "rm_learning_rate")


def load_eval_set(work: Path, tokenizer, args: Args):
    """Held-out prompt ids and answers, and the SFT policy's reference samples of them with their gold (seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    test = [json.loads(line) for line in (work / "data" / "test.jsonl").read_text().splitlines()]
    prompts, answers = base.encode(tokenizer, test)
    cache = work / "sft_reference.json"
    if not cache.exists():
        torch.set_num_threads(args.prep_threads)
        sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
        samples = base.sample(sft, prompts, args.eval_samples, 0.7, args.response_length, tokenizer.eos_token_id, 0)
        cache.write_text(json.dumps(samples))
    samples = json.loads(cache.read_text())
    return dict(
        prompts=prompts,
        answers=answers,
        sft_samples=samples,
        sft_gold=gold_scores(tokenizer, samples, answers, args.eval_samples),
    )


def prepare(args: Args):
    """Build (or load) the prep: base's data and SFT policy, RL prompts in the reward-model scripts' format, the SFT
    reference samples, the proxy reward model. Returns the prep numbers; refuses a prep built with other flags."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    prep_file = work / "prep_paper.json"
    wanted = {name: getattr(args, name) for name in PREP_FLAGS}
    if prep_file.exists():
        prep = json.loads(prep_file.read_text())
        if prep.get("flags") != wanted:
            sys.exit(
                f"error: the prep in {work} was built with {prep.get('flags')}, this invocation asks for "
                f"{wanted}; "
                "pass another --work-dir (and --results-dir) or delete that folder"
            )
        return prep
    start = time.time()
    sft_prep = base.prepare(args, task)  # data, tokenizer, SFT (prep.json; its own flags check)
    torch.set_num_threads(args.prep_threads)
    log = lambda msg: print(f"[prep {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    train = [json.loads(line) for line in (work / "data" / "train.jsonl").read_text().splitlines()]
    (work / "prompts").mkdir(exist_ok=True)  # what --reward model reads: the prompt text in the "query" field
    base.write_jsonl(
        work / "prompts" / "train.jsonl",
        [{"query": base.PROMPT_TEMPLATE.format(question=p["question"])} for p in train],
    )
    eval_set = load_eval_set(work, tokenizer, args)
    rm_start = time.time()
    rm_stats = train_reward_model(
        args, tokenizer, base.encode(tokenizer, train), eval_set, work / "sft", work / "rm", log
    )
    prep = dict(
        flags=wanted,
        **{k: v for k, v in sft_prep.items() if k not in ("flags", "initial_policy")},
        **rm_stats,
        rm_seconds=round(time.time() - rm_start),
    )
    sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    rm = load_rm(work / "rm")
    # other draws than the reference's, as every run's update 0: the SFT policy's win-rate against itself, ~0.5
    prep["initial_policy"] = evaluate(sft, sft, rm, tokenizer, eval_set, prep, args, seed=999)
    prep["total_seconds"] = round(time.time() - start) + sft_prep["total_seconds"]
    prep_file.write_text(json.dumps(prep, indent=1))
    log(json.dumps({k: v for k, v in prep.items() if k != "sft_history"}))
    return prep


def load_rm(folder: Path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()


# SWEEP: one subprocess per (algorithm, setting, learning rate, seed), then the evaluation of each of its checkpoints
def result_path(args: Args, algo: str, setting: str, learning_rate: float, seed: int):
    name = f"{algo}__{setting}__lr{learning_rate:g}__seed{seed}.json"
    return Path(args.results_dir) / sweep_of(args.gate)[0] / name


def run_one(
    args: Args,
    prep,
    algo: str,
    setting: str,
    learning_rate: float,
    seed: int,
    path: Path,
    rm_dir: Optional[Path] = None,
    overrides: Optional[dict] = None,
    extra: Optional[dict] = None,
):
    """One run and the evaluation of its checkpoints. A run on a gate candidate's miniature (--gate, the sweeps)
    passes its own proxy (rm_dir; prep then holds its missing-EOS penalty), flag overrides ({"--kl-coef": "0.01"}) and
    fields to record (extra)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    rm_dir = Path(rm_dir or work / "rm")
    spec = ALGORITHMS[algo]
    script_key, n, flags_of_setting = base.setting_flags(setting)
    flags = COMMON_FLAGS + spec["flags"] + ["--learning-rate", f"{learning_rate:g}"]
    for key, value in {
        "{sft}": work / "sft",
        "{rm}": rm_dir,
        "{prompts}": work / "prompts",
        "{penalty}": prep["missing_eos_penalty"],
    }.items():
        flags = [f.replace(key, str(value)) for f in flags]
    for flag, value in (overrides or {}).items():
        if flag in flags:
            flags[flags.index(flag) + 1] = str(value)
        else:
            flags += [flag, str(value)]
    cwd = work / "runs" / path.parent.name / path.stem  # two sweeps' runs of the same name never share a folder
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    script = Path(args.scripts_dir) / spec[script_key]
    cmd = [
        sys.executable,
        str(script),
        *flags,
        *flags_of_setting,
        "--seed",
        str(seed),
        *[str(x) for item in base.budget(args, setting).items() for x in item],
        "--output-dir",
        str(cwd / "model"),
    ]
    print(f"== {path.stem}: {' '.join(cmd)}", flush=True)
    start = time.time()
    common.run_script(cmd, cwd, path.stem)
    run_seconds = time.time() - start
    (metrics_path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    points = [(int(c.name.split("_")[1]) * n, c / "policy") for c in (cwd / "runs").glob("*/checkpoint_*")]
    points = [(0, work / "sft")] + sorted(points) + [(args.num_updates, cwd / "model")]
    torch.set_num_threads(args.prep_threads)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    sft, rm = AutoModelForCausalLM.from_pretrained(work / "sft").eval(), load_rm(rm_dir)
    eval_set = load_eval_set(work, tokenizer, args)
    # the evaluation seed differs per run seed, not per setting or point: all are compared on the same random draws
    curve = [
        dict(
            updates=u,
            **evaluate(
                AutoModelForCausalLM.from_pretrained(folder).eval(),
                sft,
                rm,
                tokenizer,
                eval_set,
                prep,
                args,
                seed=1000 + seed,
            ),
        )
        for u, folder in points
    ]
    over_run = lambda key, how: how([m[key] for m in metrics]) if all(key in m for m in metrics) else None
    off_policy = dict(
        logprob_gap_mean=over_run("async/behaviour_learner_logprob_gap", lambda v: sum(v) / len(v)),
        importance_ratio_max=over_run("policy/importance_ratio_max", max),
        clipfrac_mean=over_run("policy/clipfrac", lambda v: sum(v) / len(v)),
    )
    result = dict(
        algorithm=algo,
        setting=setting,
        learning_rate=learning_rate,
        seed=seed,
        **(extra or {}),
        command=cmd[1:],
        curve=curve,
        off_policy=off_policy,
        episodes=metrics[-1]["episodes"],
        train_scores=[m["objective/scores"] for m in metrics if "objective/scores" in m],
        run_seconds=round(run_seconds, 1),
        eval_seconds=round(time.time() - start - run_seconds, 1),
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        commit=subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
    )
    path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)
    print(
        "   win "
        + " ".join(f"{p['win_rate']:.3f}" for p in curve)
        + "\n   proxy "
        + " ".join(f"{p['proxy']:.2f}" for p in curve)
        + f"\n   final KL {curve[-1]['kl']:.3f}  "
        f"({run_seconds:.0f}s run + {result['eval_seconds']:.0f}s eval)",
        flush=True,
    )
    return time.time() - start


# GATE CANDIDATES (issue 41's gate search, now in git's history, recalibrated the miniature until sync-1
# over-optimises): the two still in use, the gate sweep's (--gate) and the pilot's, on which the pre-registered sweep
# runs (PILOT_GATE). `rm`: the proxy's training (epochs; {} is the prep's own proxy); `updates` and
# `eval_every`: the run's length; `lr`; `flags`: overrides of the algorithms' flags (RLOO and PPO read --kl-coef, DPO
# --beta; a flag an algorithm does not read is not passed to it).
GATE_CANDIDATES = {
    "rm-e1__u512__kl0.01": dict(
        rm=dict(epochs=1), updates=512, eval_every=64, lr=1e-4, flags={"--kl-coef": "0.01", "--beta": "0.03"}
    ),
    "rm-full__u512": dict(rm=dict(), updates=512, eval_every=64, lr=1e-4, flags={}),
}


def gate_rm(args: Args, prep, rm_spec: dict):
    """The candidate's proxy in work_dir/gate_rm/<name> (built once; the full proxy is the prep's own), and its
    missing-EOS penalty."""
    from transformers import AutoTokenizer

    work = Path(args.work_dir)
    if not rm_spec:
        return work / "rm", prep
    name = "__".join(f"{k}{v}" for k, v in sorted(rm_spec.items()))
    folder, stats_file = work / "gate_rm" / name, work / "gate_rm" / f"{name}.json"
    if not stats_file.exists():
        import dataclasses

        tokenizer = AutoTokenizer.from_pretrained(work / "sft")
        train = [json.loads(line) for line in (work / "data" / "train.jsonl").read_text().splitlines()]
        rm_args = dataclasses.replace(args, rm_epochs=rm_spec.get("epochs", args.rm_epochs))
        log = lambda msg: print(f"[gate rm {name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)
        stats = train_reward_model(
            rm_args,
            tokenizer,
            base.encode(tokenizer, train),
            load_eval_set(work, tokenizer, args),
            work / "sft",
            folder,
            log,
        )
        stats_file.write_text(json.dumps(dict(spec=rm_spec, **stats), indent=1))
        log(json.dumps(stats))
    return folder, dict(prep, **json.loads(stats_file.read_text()))


def gate_miniature(args: Args, prep, name: str, algo: str):
    """A run of `algo` on gate candidate `name`'s miniature (--gate, the sweeps): the prep with its proxy's
    missing-EOS penalty, and run_one's rm_dir, the one flag override the algorithm reads and the fields to record."""
    cand = GATE_CANDIDATES[name]
    rm_dir, rm_prep = gate_rm(args, prep, cand["rm"])
    reads = "--beta" if algo == "dpo" else "--kl-coef"
    return rm_prep, dict(
        rm_dir=rm_dir,
        overrides={f: v for f, v in cand["flags"].items() if f == reads},
        extra=dict(
            gate_candidate=name,
            gate_spec=cand,
            scripts_dir=args.scripts_dir,
            rm_stats={k: v for k, v in rm_prep.items() if k.startswith("rm_")},
        ),
    )


def may_start(args: Args, path: Path, invocation_start: float, durations: list, new_runs: int) -> bool:
    """Whether this invocation may start the run of `path`: within --max-runs, and its longest run so far would still
    end within --time-budget-hours (every sweep shares this rule)."""
    if args.max_runs is not None and new_runs >= args.max_runs:
        return False
    expected = max(durations) if durations else 0.0
    if args.time_budget_hours is not None and time.time() - invocation_start + expected > 3600 * args.time_budget_hours:
        print(f"== time budget reached: not starting {path.stem}")
        return False
    return True


# REPORT: rebuilt from the result files alone
def value_at_kl(curve, kl: float, key: str = "win_rate"):
    """The curve's value where it first reaches this KL (in update order), linear between evaluations."""
    for a, b in zip(curve, curve[1:]):
        if a["kl"] <= kl <= b["kl"]:
            t = (kl - a["kl"]) / (b["kl"] - a["kl"]) if b["kl"] > a["kl"] else 1.0
            return a[key] + t * (b[key] - a[key])
    return float("nan")


def reach(curve):
    """The largest KL a curve reaches: every KL below it is first reached somewhere along the curve (it starts at 0)."""
    return max(p["kl"] for p in curve)


def shortfall(curve, reference, kl_max: float):
    """Mean of reference(kl) - curve(kl) over KL_GRID points of (0, kl_max]: how far the setting's win-rate curve sits
    below sync-1's at matched KL (the paper's comparison, as one number)."""
    grid = [kl_max * (i + 1) / KL_GRID for i in range(KL_GRID)]
    return sum(value_at_kl(reference, x) - value_at_kl(curve, x) for x in grid) / KL_GRID


def mean_ci(values):
    """Mean and the half-width of its 95% confidence interval (Student's t over seeds)."""
    t95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return m, t95.get(len(values) - 1, 1.96) * sd / math.sqrt(len(values))


def load_results(results_dir: Path, name: str, learning_rate: float):
    """{(algorithm, setting): [runs at learning_rate]}, and {(algorithm, rate): [sync-1 runs]} (the gate), from the
    result folder `name` (sweep_of)."""
    runs, gate = defaultdict(list), defaultdict(list)
    for path in sorted((results_dir / name).glob("*__*__lr*__seed*.json")):
        r = json.loads(path.read_text())
        if r["setting"] == "sync-1":
            gate[(r["algorithm"], r["learning_rate"])].append(r)
        if r["learning_rate"] == learning_rate:
            runs[(r["algorithm"], r["setting"])].append(r)
    return runs, gate


def scores_of(runs, algo):
    """Per setting, each seed's shortfall against the same seed's sync-1 run, over the KL range that every run of the
    algorithm reaches."""
    found = [s for s in settings_of(algo, GATE_SYNC_N) if runs.get((algo, s))]
    if not runs.get((algo, "sync-1")):
        return None, {}
    kl_max = min(reach(r["curve"]) for s in found for r in runs[(algo, s)])
    base_runs = {r["seed"]: r["curve"] for r in runs[(algo, "sync-1")]}
    return kl_max, {
        s: [shortfall(r["curve"], base_runs[r["seed"]], kl_max) for r in runs[(algo, s)] if r["seed"] in base_runs]
        for s in found
        if s != "sync-1"
    }


def by_seed(runs, algo, scores):
    """scores_of's lists as {setting: {seed: shortfall}} (its lists follow the runs' order, sync-1's seeds only)."""
    base_seeds = {r["seed"] for r in runs.get((algo, "sync-1"), [])}
    return {s: dict(zip([r["seed"] for r in runs[(algo, s)] if r["seed"] in base_seeds], v)) for s, v in scores.items()}


def final_drops(runs, algo):
    """The paper's measure (its Fig. 4 plots where each N's *final* point lands in win-rate and KL): per setting, each
    seed's final gold win-rate below the same seed's sync-1 final win-rate, as {setting: {seed: drop}}; positive =
    staleness costs."""
    base_final = {r["seed"]: r["curve"][-1]["win_rate"] for r in runs.get((algo, "sync-1"), [])}
    return {
        s: {
            r["seed"]: base_final[r["seed"]] - r["curve"][-1]["win_rate"]
            for r in runs[(algo, s)]
            if r["seed"] in base_final
        }
        for s in settings_of(algo, GATE_SYNC_N)
        if s != "sync-1" and runs.get((algo, s)) and base_final
    }


def ranked_mean(per_setting, algo):
    """Each seed's mean over the RANKED settings (async under `paper`), for the seeds that have all of them."""
    named = lambda s: f"{s}-paper" if s.startswith("async") and ALGORITHMS[algo]["corrections"] else s
    tables = [per_setting.get(named(s), {}) for s in RANKED]
    seeds = sorted(set.intersection(*[set(t) for t in tables]))
    return [sum(t[seed] for t in tables) / len(tables) for seed in seeds]


def over_optimisation(rs):
    """Whether sync-1 runs over-optimise: the evaluation where the seeds' mean gold peaks, the fall of each seed's gold
    from there to the end, and the rise of its proxy over the same stretch (mean ± 95% CI over seeds). The verdict:
    "yes" = gold rose, peaked and fell by more than its CI while the proxy's mean still rises (over-optimisation);
    "from the start" = gold falls from update 0 while the proxy rises (a proxy exploited at once, never tracked);
    "collapse" = gold and proxy fall together; "no" = gold does not fall by more than its CI. The peak is picked on
    the same curves, which biases the fall up: hence a CI, not a point, decides."""
    curve = mean_curve(rs)
    peak = max(range(len(curve)), key=lambda i: curve[i]["gold"])
    fall = mean_ci([r["curve"][peak]["gold"] - r["curve"][-1]["gold"] for r in rs])
    rise = mean_ci([r["curve"][-1]["proxy"] - r["curve"][peak]["proxy"] for r in rs])
    fell = peak < len(curve) - 1 and not math.isnan(fall[1]) and fall[0] - fall[1] > 0
    verdict = (
        "one seed: no CI"
        if len(rs) < 2
        else "no"
        if not fell
        else "collapse"
        if rise[0] <= 0
        else "yes"
        if peak > 0
        else "from the start"
    )
    return dict(
        peak_update=round(curve[peak]["updates"]),
        peak_gold=curve[peak]["gold"],
        final_gold=curve[-1]["gold"],
        gold_fall=fall,
        proxy_rise=rise,
        verdict=verdict,
        over_optimised=verdict in ("yes", "from the start"),
    )


def excursions(runs, algo, floor):
    """Per setting, the runs that leave the ground every sync-1 run of the algorithm stays on: a *KL excursion* is an
    evaluation at a KL above the largest any sync-1 run reaches; a *dip* is a win-rate below `floor`, the lowest
    win-rate of the SFT policy against itself over the sweep's evaluation draws. Returns the KL bound and
    {setting: [(seed, peak KL, lowest win-rate)]}."""
    if not runs.get((algo, "sync-1")):
        return None, {}
    bound = max(reach(r["curve"]) for r in runs[(algo, "sync-1")])
    return bound, {
        s: sorted((r["seed"], reach(r["curve"]), min(p["win_rate"] for p in r["curve"])) for r in runs[(algo, s)])
        for s in settings_of(algo, GATE_SYNC_N)
        if s != "sync-1" and runs.get((algo, s))
    }


def report(results_dir: Path, candidate: Optional[str] = None):
    """<name>.md and its plots (name, N and learning rate: sweep_of(candidate)), from the result files alone."""
    name, _, learning_rate = sweep_of(candidate)
    invocation = "--report-only" + (f" --gate {candidate}" if candidate else "")
    runs, gate = load_results(results_dir, name, learning_rate)
    prep_path = results_dir / name / "prep.json"
    prep = json.loads(prep_path.read_text()) if prep_path.exists() else None
    ci = lambda mc: f"{mc[0]:+.3f} ± {mc[1]:.3f}" if not math.isnan(mc[1]) else f"{mc[0]:+.3f}"
    plain = lambda mc: f"{mc[0]:.3f} ± {mc[1]:.3f}" if not math.isnan(mc[1]) else f"{mc[0]:.3f}"
    pv = lambda p: "–" if math.isnan(p) else "<0.001" if p < 0.001 else f"{p:.3f}"
    bold = lambda text, p: f"**{text}**" if p < 0.05 else text
    lines = [
        "Staleness under the paper's protocol (Noukhovitch et al. 2025, Sec. 3), in miniature: every algorithm "
        "optimises a proxy reward model trained on gold-labelled pairs; measured is the gold win-rate against the "
        "SFT policy (held-out problems, T=0.7, ties half) versus KL(pi || pi_sft). The paper's statement, as its "
        'Fig. 4 caption puts it: "Online DPO is more robust to off-policyness than PPO, RLOO" (N in '
        "{1, 2, 4, 8, 16}), judged by where each N's final point lands in win-rate and KL.",
        f"Produced by `python benchmark/staleness_paper.py {invocation}` from the result files (see its "
        "docstring). Every ± is a 95% CI over seeds. A difference is *separated* (bold) when its two-sided t-test "
        "(paired by seed, or Welch's between algorithms) survives a Holm-Bonferroni correction over the family "
        "each table names: Holm p < 0.05.",
        *(
            [f"Miniature: gate candidate `{candidate}` of GATE_CANDIDATES (issue 41), {GATE_CANDIDATES[candidate]}."]
            if candidate
            else []
        ),
        "",
    ]
    # the SFT policy against itself: update 0 of every run is the SFT policy, each run seed on its own draws
    starts = sorted({r["seed"]: r["curve"][0]["win_rate"] for rs in runs.values() for r in rs}.items())
    floor = min(w for _, w in starts) if starts else float("nan")
    if prep:
        init = prep["initial_policy"]
        lines += [
            f"SFT policy: gold {init['gold']:.3f}, exact {init['exact']:.3f}, win-rate against itself "
            f"{init['win_rate']:.3f} (prep draw)"
            + (
                f", {min(w for _, w in starts):.3f}–{max(w for _, w in starts):.3f} over the sweep's "
                f"{len(starts)} evaluation draws (update 0 of each run seed): the noise of one evaluation"
                if starts
                else ""
            )
            + f". Proxy RM: {prep['rm_pairs']:,} gold-labelled pairs "
            f"({prep['rm_tied_pairs']:,} tied pairs dropped) of {prep['rm_pairs'] + prep['rm_tied_pairs']:,} "
            f"(SFT samples: {2 * (prep['rm_pairs'] + prep['rm_tied_pairs']):,}), held-out pair accuracy "
            f"{prep['rm_test_pair_accuracy']:.3f}, correlation with gold on held-out SFT samples "
            f"{prep['rm_gold_correlation']:.3f}; missing-EOS penalty {prep['missing_eos_penalty']}.",
            "",
        ]
    verdicts = {}
    if gate:
        lines += [
            "Gate (sync-1): the proxy reward and the gold along the run, per learning rate; the rate every "
            f"algorithm uses is marked * ({learning_rate:g}). Over-optimisation shows as proxy rising while gold "
            "peaks and falls: the last columns give the update where the seeds' mean gold peaks, the fall of "
            "gold from there to the end and the proxy's rise over the same stretch (paired by seed); "
            "over-optimised = the fall's CI above 0 while the proxy rises.",
            "",
            "| algorithm | learning rate | seeds | proxy along the run | gold along the run | win-rate along the "
            "run | final KL | gold peak (update) | gold fall after it | proxy rise after it | over-optimised |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (algo, lr), rs in sorted(gate.items()):
            mean = lambda key: " ".join(
                f"{sum(r['curve'][i][key] for r in rs) / len(rs):.3f}" for i in range(len(rs[0]["curve"]))
            )
            o = over_optimisation(rs)
            if lr == learning_rate:
                verdicts[algo] = o
            lines.append(
                f"| {algo} | {lr:g}{' *' if lr == learning_rate else ''} | {len(rs)} | {mean('proxy')} | "
                f"{mean('gold')} | {mean('win_rate')} | "
                f"{sum(r['curve'][-1]['kl'] for r in rs) / len(rs):.2f} | {o['peak_gold']:.3f} "
                f"({o['peak_update']}) | {ci(o['gold_fall'])} | {ci(o['proxy_rise'])} | "
                f"{o['verdict']} |"
            )
        if verdicts and not any(o["over_optimised"] for o in verdicts.values()):
            lines += [
                "",
                f"At {learning_rate:g} no algorithm's sync-1 mean gold falls by more than its CI after its peak (single "
                "seeds may still escape to large KL: see the excursions). Where sync-1 gains, a stale run that moves "
                "more slowly also ends lower, so a drop below sync-1 is the share of that gain lost; where sync-1 "
                "neither gains nor falls, the drops are not read as robustness, and the paper's ranking is "
                "**undetermined here**.",
            ]
        elif verdicts:
            start = [a for a in verdicts if verdicts[a]["verdict"] == "from the start"]
            peaked = [a for a in verdicts if verdicts[a]["over_optimised"] and a not in start]
            rest = [a for a in verdicts if not verdicts[a]["over_optimised"]]
            if peaked:
                lines += [
                    "",
                    f"At {learning_rate:g} sync-1 over-optimises ({', '.join(peaked)}"
                    + (f"; not {', '.join(rest)}" if rest else "")
                    + "): its gold falls by more than its CI while the proxy still rises, so a stale run can land "
                    "worse, not only later, and for these the tables below measure robustness as the paper does.",
                ]
            if start:
                lines += [
                    "",
                    f"At {learning_rate:g} sync-1 over-optimises from the start ({', '.join(start)}): its gold is "
                    "highest at update 0 and falls while the proxy rises, so a run that moves less lands higher. For "
                    "these the final point ranks slowness, not robustness to off-policy data, and the paper's ranking "
                    "cannot be read from it.",
                ]

    # 1. the paper's measure: the final point of each setting, and its drop below sync-1's (paired by seed)
    algos = [a for a in ALGORITHMS if runs.get((a, "sync-1"))]
    drops = {a: final_drops(runs, a) for a in algos}
    family = [(a, s) for a in algos for s in drops[a]]
    tests = [one_sample_t(list(drops[a][s].values()))[1] for a, s in family]
    adjusted = dict(zip(family, holm(tests)))
    raw = dict(zip(family, tests))
    if algos:
        lines += [
            "",
            "**The paper's measure: where each setting's final point lands** (Fig. 4). Final gold win-rate "
            "and final KL after the run's updates, the best win-rate along the run, and the final win-rate's "
            "drop below sync-1's final win-rate, paired by seed (positive = staleness costs); Holm over the "
            f"{len(family)} drops of the table.",
            "",
            "| algorithm | setting | final win-rate | final KL | best win-rate | drop below sync-1 | p | "
            "Holm p | seeds |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for a in algos:
            for setting in ["sync-1"] + list(drops[a]):
                rs = runs[(a, setting)]
                final = mean_ci([r["curve"][-1]["win_rate"] for r in rs])
                kl = mean_ci([r["curve"][-1]["kl"] for r in rs])
                best = mean_ci([max(p["win_rate"] for p in r["curve"]) for r in rs])
                if setting == "sync-1":
                    lines.append(
                        f"| {a} | sync-1 | {plain(final)} | {plain(kl)} | {plain(best)} | – | – | – | {len(rs)} |"
                    )
                    continue
                d = mean_ci(list(drops[a][setting].values()))
                lines.append(
                    f"| {a} | {setting} | {plain(final)} | {plain(kl)} | {plain(best)} | "
                    f"{bold(ci(d), adjusted[(a, setting)])} | {pv(raw[(a, setting)])} | "
                    f"{pv(adjusted[(a, setting)])} | {len(drops[a][setting])} |"
                )
        lines += algorithm_comparison("final win-rate drop", {a: ranked_mean(drops[a], a) for a in algos}, ci, pv)

    # 2. the matched-KL view: shortfall below sync-1 over the KL range every run of the algorithm reaches
    table, shortfalls, corrections = [], {}, []
    for algo in ALGORITHMS:
        kl_max, scores = scores_of(runs, algo)
        if kl_max is None:
            continue
        shortfalls[algo] = by_seed(runs, algo, scores)
    family = [(a, s) for a in shortfalls for s in shortfalls[a]]
    tests = [one_sample_t(list(shortfalls[a][s].values()))[1] for a, s in family]
    adjusted, raw = dict(zip(family, holm(tests))), dict(zip(family, tests))
    for algo in shortfalls:
        kl_max = scores_of(runs, algo)[0]
        base_rs = runs[(algo, "sync-1")]
        peak = mean_ci([max(p["win_rate"] for p in r["curve"]) for r in base_rs])
        table.append(f"| {algo} | sync-1 | – | – | – | {peak[0]:.3f} | {kl_max:.2f} | {len(base_rs)} |")
        for setting, values in shortfalls[algo].items():
            peaks = [max(p["win_rate"] for p in r["curve"]) for r in runs[(algo, setting)]]
            table.append(
                f"| {algo} | {setting} | {bold(ci(mean_ci(list(values.values()))), adjusted[(algo, setting)])}"
                f" | {pv(raw[(algo, setting)])} | {pv(adjusted[(algo, setting)])} | {mean_ci(peaks)[0]:.3f} | "
                f"{kl_max:.2f} | {len(values)} |"
            )
    for algo in shortfalls:
        for setting in [
            s
            for s in shortfalls[algo]
            if s.endswith("-behaviour") and s.replace("-behaviour", "-paper") in shortfalls[algo]
        ]:
            # the two corrections on the same seeds: the difference of each seed's shortfalls
            behaviour, paper = shortfalls[algo][setting], shortfalls[algo][setting.replace("-behaviour", "-paper")]
            paired = [behaviour[seed] - paper[seed] for seed in behaviour if seed in paper]
            corrections.append((algo, setting.split("-")[1], paired))
    if table:
        lines += [
            "",
            "**Matched KL (a second view)**: the shortfall = the mean, over the KL range every run of the "
            "algorithm reaches, of sync-1's win-rate minus the setting's (same seed); positive = staleness "
            f"costs. Holm over the {len(family)} shortfalls of the table. The range covers only the start of "
            "most sync-1 runs.",
            "",
            "| algorithm | setting | shortfall below sync-1 | p | Holm p | peak win-rate | KL range | seeds |",
            "|---|---|---|---|---|---|---|---|",
        ] + table
        # how much of a sync-1 run the range covers: the share of its updates before it first reaches the range's end
        covered = {
            a: [
                value_at_kl(r["curve"], scores_of(runs, a)[0], "updates") / r["curve"][-1]["updates"]
                for r in runs[(a, "sync-1")]
            ]
            for a in shortfalls
        }
        lines += [
            "",
            "sync-1 first reaches the end of the KL range after "
            + ", ".join(f"{a} {min(v):.0%}–{max(v):.0%}" for a, v in covered.items())
            + " of its updates (per seed).",
        ]
        ranges = ", ".join(f"{a} 0–{scores_of(runs, a)[0]:.2f}" for a in shortfalls)
        caveat = (
            f"Not read as a ranking: each algorithm's KL range differs ({ranges}), so these pairs compare different "
            "stretches of the runs."
        )
        per_seed = {a: ranked_mean(shortfalls[a], a) for a in shortfalls}
        lines += algorithm_comparison("matched-KL shortfall", per_seed, ci, pv, caveat)
    if corrections:
        tests = [one_sample_t(paired)[1] for _, _, paired in corrections]
        lines += [
            "",
            "`behaviour` against `paper` at the same K, paired by seed: the shortfall under `behaviour` "
            "minus the shortfall under `paper` (mean ± 95% CI over seeds); negative = `behaviour` keeps more "
            f"gold win-rate at matched KL. Holm over the {len(corrections)} rows.",
            "",
            "| algorithm | K | behaviour − paper | p | Holm p | seeds |",
            "|---|---|---|---|---|---|",
        ]
        for (algo, k, paired), p, h in zip(corrections, tests, holm(tests)):
            lines.append(f"| {algo} | {k} | {bold(ci(mean_ci(paired)), h)} | {pv(p)} | {pv(h)} | {len(paired)} |")

    # 3. what the shared range hides: runs that leave sync-1's KL range or dip below the SFT policy's own win-rate
    rows, pairs = [], []
    for algo in algos:
        bound, found = excursions(runs, algo, floor)
        for setting, rs in found.items():
            out, dips = [r for r in rs if r[1] > bound], [r for r in rs if r[2] < floor]
            rows.append(
                f"| {algo} | {setting} | {len(out)} of {len(rs)} | {' '.join(f'{r[1]:.2f}' for r in rs)} | "
                f"{len(dips)} of {len(rs)} | {' '.join(f'{r[2]:.3f}' for r in rs)} |"
            )
        for setting in [s for s in found if s.endswith("-paper") and s.replace("-paper", "-behaviour") in found]:
            p_rs, b_rs = found[setting], found[setting.replace("-paper", "-behaviour")]
            count = lambda rs: sum(r[1] > bound for r in rs)
            pairs.append((algo, setting.split("-")[1], count(p_rs), len(p_rs), count(b_rs), len(b_rs)))
    if rows:
        lines += [
            "",
            "**Excursions** (what the matched-KL range hides): per run seed in order, the largest KL an "
            "evaluation reaches and the lowest win-rate. A KL excursion = above the largest KL of any sync-1 run "
            "of the algorithm ("
            + ", ".join(f"{a} {excursions(runs, a, floor)[0]:.2f}" for a in algos)
            + f"); a dip = a win-rate below {floor:.3f}, the lowest of the SFT policy against itself.",
            "",
            "| algorithm | setting | KL excursions | largest KL per seed | dips | lowest win-rate per seed |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    if pairs:
        tests = [fisher_exact(a, n, b, m) for _, _, a, n, b, m in pairs]
        lines += [
            "",
            "KL excursions under `paper` against `behaviour` at the same K: Fisher's exact test "
            f"(two-sided), Holm over the {len(pairs)} rows.",
            "",
            "| algorithm | K | paper | behaviour | Fisher p | Holm p |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {algo} | {k} | {a} of {n} | {b} of {m} | {pv(p)} | {pv(h)} |"
            for (algo, k, a, n, b, m), p, h in zip(pairs, tests, holm(tests))
        ]
    (results_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    if runs or gate:
        plot(runs, gate, results_dir, name)
    return lines


# PILOT (issue 54, item 2): can this miniature show a cost of staleness at all? The gate's sync-1 runs lose gold from
# update 0, so a stale run that moves less lands higher there; the two-epoch proxy at the paper's anchors (--kl-coef
# 0.05, DPO --beta 0.1) gave every algorithm a gain, but the first sweep stopped at N = 32. The pilot asked for
# N = 128; its runs and report are in git's history. Its rule stays: the pre-registered sweep applies it again on its
# own prep (staleness_sweep.PREP_PILOT_RULE, whose report names PILOT_RULE here).
PILOT_GATE = "rm-full__u512"  # the prep's own (two-epoch) proxy, 512 updates, the algorithms' default anchors
PILOT_SYNC_N = (1, 128)  # sync-128: 4 generation rounds of 128 updates, 127 of every 128 updates off-policy
PILOT_SEEDS = (1, 2, 3)
PILOT_FINAL_UPDATES = (384, 512)  # the last two evaluations both settings have (sync-128 evaluates once a round)
PILOT_COST = 0.02  # the drop the planned 8-seed sweep can detect (issue 54: per-seed SD 0.010-0.013)
PILOT_RULE = (
    "**The rule, fixed before the first run** (issue 54, item 2; this header and PILOT_RULE were committed before any "
    "pilot run). Per run, *final* = the mean gold win-rate of the evaluations at updates "
    f"{' and '.join(map(str, PILOT_FINAL_UPDATES))}; *gain* = final minus the run's update-0 win-rate (the SFT policy "
    "against itself on that seed's draws). Per algorithm: the *drop* = sync-1's final minus sync-128's, paired by "
    "seed; *kept* = sync-128's mean gain over sync-1's. A run *escapes* when its largest KL exceeds twice the largest "
    "KL of any sync-1 run of the algorithm. An algorithm **shows a cost** when its mean drop is at least "
    f"{PILOT_COST} (what the 8-seed sweep can detect), or its drop is separated from 0 (one-sample t over seeds, Holm "
    "over the 3 algorithms, p < 0.05), or any of its sync-128 runs escapes. It **can answer** only if sync-1's mean "
    "gain is positive. **Decision:** the pre-registered 8-seed sweep (issue 54, item 3) runs if any algorithm that "
    "can answer shows a cost; otherwise the question is stated as undetermined in this miniature (item 4)."
)


def pilot_final(run):
    """The pilot's final win-rate of one run: the mean over the evaluations at PILOT_FINAL_UPDATES."""
    points = {round(p["updates"]): p["win_rate"] for p in run["curve"]}
    return sum(points[u] for u in PILOT_FINAL_UPDATES) / len(PILOT_FINAL_UPDATES)


def pilot_verdicts(runs):
    """Per algorithm with both settings, PILOT_RULE's numbers: the gains, the drop by seed, kept, the escapes, the
    t-test's p (Holm over the algorithms) and the verdicts 'can answer' and 'shows a cost'."""
    stale = f"sync-{PILOT_SYNC_N[-1]}"
    found = {}
    for algo in ALGORITHMS:
        base_runs = {r["seed"]: r for r in runs.get((algo, "sync-1"), [])}
        stale_runs = {r["seed"]: r for r in runs.get((algo, stale), [])}
        seeds = sorted(set(base_runs) & set(stale_runs))
        if not seeds:
            continue
        gain = lambda r: pilot_final(r) - r["curve"][0]["win_rate"]
        base_gain = [gain(base_runs[s]) for s in seeds]
        stale_gain = [gain(stale_runs[s]) for s in seeds]
        drops = [pilot_final(base_runs[s]) - pilot_final(stale_runs[s]) for s in seeds]
        bound = 2 * max(reach(r["curve"]) for r in base_runs.values())
        found[algo] = dict(
            seeds=seeds,
            base_final=[pilot_final(base_runs[s]) for s in seeds],
            stale_final=[pilot_final(stale_runs[s]) for s in seeds],
            base_gain=base_gain,
            stale_gain=stale_gain,
            drops=drops,
            kept=sum(stale_gain) / sum(base_gain) if sum(base_gain) > 0 else float("nan"),
            base_kl=[base_runs[s]["curve"][-1]["kl"] for s in seeds],
            stale_kl=[stale_runs[s]["curve"][-1]["kl"] for s in seeds],
            escapes=[s for s in seeds if reach(stale_runs[s]["curve"]) > bound],
            kl_bound=bound,
            p=one_sample_t(drops)[1],
        )
    for algo, p in zip(found, holm([v["p"] for v in found.values()])):
        v = found[algo]
        v["holm_p"] = p
        v["can_answer"] = sum(v["base_gain"]) > 0
        separated = p < 0.05 and sum(v["drops"]) > 0
        v["cost"] = sum(v["drops"]) / len(v["drops"]) >= PILOT_COST or separated or bool(v["escapes"])
    return found


def pilot_decision(found):
    """PILOT_RULE's decision on pilot_verdicts' numbers: True (the sweep runs), False (no sweep) or None (pending, some
    algorithm lacks a seed), and its sentence for the report."""
    complete = all(len(v["seeds"]) == len(PILOT_SEEDS) for v in found.values()) and len(found) == len(ALGORITHMS)
    costly = [a for a, v in found.items() if v["can_answer"] and v["cost"]]
    if not complete:
        return None, "Decision: pending (the pilot is not complete)."
    if costly:
        verb = "shows" if len(costly) == 1 else "show"
        return True, f"Decision: **the sweep runs** ({', '.join(costly)} {verb} a cost under the rule)."
    return False, (
        "Decision: **no sweep**; no algorithm that can answer shows a cost under the rule, so the question is "
        "undetermined in this miniature (issue 54, item 4)."
    )


def pilot_table(found):
    """pilot_verdicts' numbers as a markdown table, one row per algorithm."""
    stale = f"sync-{PILOT_SYNC_N[-1]}"
    ci = lambda values: "{:+.3f} ± {:.3f}".format(*mean_ci(values)) if len(values) > 1 else f"{values[0]:+.3f}"
    plain = lambda values: "{:.3f} ± {:.3f}".format(*mean_ci(values)) if len(values) > 1 else f"{values[0]:.3f}"
    pv = lambda p: "–" if math.isnan(p) else "<0.001" if p < 0.001 else f"{p:.3f}"
    lines = [
        f"| algorithm | seeds | sync-1 gain | {stale} gain | sync-1 final | {stale} final | drop (sync-1 − "
        f"{stale}) | p | Holm p | kept | sync-1 final KL | {stale} final KL | escapes | can answer | shows a cost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algo, v in found.items():
        kept = "–" if math.isnan(v["kept"]) else f"{v['kept']:.0%}"  # no gain at sync-1: nothing to keep
        lines.append(
            f"| {algo} | {len(v['seeds'])} | {ci(v['base_gain'])} | {ci(v['stale_gain'])} | "
            f"{plain(v['base_final'])} | {plain(v['stale_final'])} | {ci(v['drops'])} | {pv(v['p'])} | "
            f"{pv(v['holm_p'])} | {kept} | {plain(v['base_kl'])} | {plain(v['stale_kl'])} | "
            f"{len(v['escapes'])} of {len(v['seeds'])} (KL > {v['kl_bound']:.2f}) | "
            f"{'yes' if v['can_answer'] else 'no'} | {'**yes**' if v['cost'] else 'no'} |"
        )
    return lines


def algorithm_comparison(what, per_seed, ci, pv, caveat: Optional[str] = None):
    """The algorithms in order of a per-seed mean over RANKED, Welch's t between each pair with Holm over the pairs,
    and the ranking those tests support: only the separated pairs (issue 41: a ranking only where Holm separates);
    `caveat`, when the measure compares unlike things, replaces that ranking."""
    ranking = {a: v for a, v in per_seed.items() if v}
    if not ranking:
        return []
    order = sorted(ranking, key=lambda a: sum(ranking[a]) / len(ranking[a]))
    lines = [
        "",
        f"Per algorithm, the {what} averaged over {', '.join(RANKED)} (async under `paper`) per seed, "
        "smallest first (an order of means, not a ranking: that is the tests' line below). The paper's claim: DPO "
        "more robust than PPO and RLOO.",
        "",
        f"| order | algorithm | mean {what} | seeds |",
        "|---|---|---|---|",
    ]
    lines += [f"| {i + 1} | {a} | {ci(mean_ci(ranking[a]))} | {len(ranking[a])} |" for i, a in enumerate(order)]
    pairs = [(a, b) for i, a in enumerate(order) for b in order[i + 1 :]]
    tests = [welch(ranking[a], ranking[b]) for a, b in pairs]
    lines += [
        "",
        f"Differences between algorithms (Welch's t on the per-seed means; Holm over the {len(pairs)} pairs):",
        "",
    ]
    for (a, b), (t, df, p), h in zip(pairs, tests, holm([t[2] for t in tests])):
        diff = sum(ranking[a]) / len(ranking[a]) - sum(ranking[b]) / len(ranking[b])
        verdict = "separated" if h < 0.05 else "not separated"
        lines.append(f"- {a} vs {b}: {diff:+.3f}, t = {t:.2f} (df {df:.1f}), p = {pv(p)}, Holm p = {pv(h)}: {verdict}")
    separated = [f"{a} ahead of {b}" for (a, b), h in zip(pairs, holm([t[2] for t in tests])) if h < 0.05]
    if caveat:
        return lines + ["", caveat]
    return lines + [
        "",
        f"Ranking the tests support (smaller {what} ahead): "
        f"{'; '.join(separated) if separated else 'none, no pair is separated'}.",
    ]


# TESTS: plain Python, so the report needs no statistics package (tests/test_staleness_paper.py checks them)
def _betainc(a: float, b: float, x: float):
    """Regularised incomplete beta I_x(a, b), by its continued fraction (Lentz's method, Numerical Recipes 6.4)."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    f, c, d = 1.0, 1.0, 0.0
    for i in range(1000):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + num / c
        c = c if abs(c) > 1e-300 else 1e-300
        f *= c * d
        if abs(1.0 - c * d) < 1e-14:
            break
    return front * (f - 1.0)


def t_test_p(t: float, df: float):
    """Two-sided p of Student's t with df degrees of freedom (df need not be an integer: Welch's)."""
    if math.isnan(t) or math.isnan(df) or df <= 0:
        return float("nan")
    return _betainc(df / 2, 0.5, df / (df + t * t))


def one_sample_t(values):
    """t and two-sided p of 'the mean is 0' (values paired by seed, so one difference per seed)."""
    n, m = len(values), sum(values) / len(values)
    if n < 2:
        return float("nan"), float("nan")
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    t = m / (sd / math.sqrt(n)) if sd > 0 else math.copysign(float("inf"), m) if m else float("nan")
    return t, (0.0 if math.isinf(t) else t_test_p(t, n - 1))


def welch(a, b):
    """Welch's t of mean(a) - mean(b), its Welch-Satterthwaite degrees of freedom, and the two-sided p."""
    if len(a) < 2 or len(b) < 2:  # no variance to test with (a sweep still under way: no seed, or one)
        return float("nan"), float("nan"), float("nan")
    var = lambda x: sum((v - sum(x) / len(x)) ** 2 for v in x) / (len(x) - 1)
    va, vb = var(a) / len(a), var(b) / len(b)
    if not va + vb > 0:
        return float("nan"), float("nan"), float("nan")
    t = (sum(a) / len(a) - sum(b) / len(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return t, df, t_test_p(t, df)


def holm(pvalues):
    """Holm-Bonferroni adjusted p-values (same order as given): the k-th smallest of m is multiplied by m - k + 1, then
    made monotone. A test of the family is *separated* when its adjusted p < 0.05, which keeps the chance of any false
    separation in the family below 5%. NaN p-values (one seed) stay NaN and do not count in m."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    adjusted, running = [float("nan")] * len(pvalues), 0.0
    for k, (p, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - k) * p))
        adjusted[i] = running
    return adjusted


def fisher_exact(hits_a: int, n_a: int, hits_b: int, n_b: int):
    """Two-sided p of Fisher's exact test on the 2x2 table (hits_a of n_a against hits_b of n_b): the summed
    probability, with the margins fixed, of every table no more likely than the one observed."""
    hits, total = hits_a + hits_b, n_a + n_b
    prob = lambda k: math.comb(n_a, k) * math.comb(n_b, hits - k) / math.comb(total, hits)
    observed = prob(hits_a)
    return min(
        1.0, sum(prob(k) for k in range(max(0, hits - n_b), min(hits, n_a) + 1) if prob(k) <= observed * (1 + 1e-9))
    )


def mean_curve(rs):
    return [
        {k: sum(p[k] for p in points) / len(points) for k in ("updates", "kl", "win_rate", "gold", "proxy")}
        for points in zip(*[r["curve"] for r in rs])
    ]


def plot(runs, gate, results_dir: Path, name: str):
    """<name>.png: win-rate vs KL, one row per algorithm (sync N | async under paper | under behaviour);
    <name>_final.png: each setting's final point, as the paper's Fig. 4;
    <name>_gate.png: proxy and gold along the sync-1 runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ALGORITHMS if any(k[0] == a for k in runs)]
    if algos:
        fig, axes = plt.subplots(len(algos), 3, figsize=(12, 3.0 * len(algos)), squeeze=False, sharey="row")
        for row, algo in zip(axes, algos):
            for col, ax in enumerate(row):
                for setting in settings_of(algo, GATE_SYNC_N):
                    kind, value, correction = base.parse_setting(setting)
                    column = 0 if kind == "sync" else 1 + CORRECTIONS.index(correction or "paper")
                    if not runs.get((algo, setting)) or (column != col and setting != "sync-1"):
                        continue
                    curve = mean_curve(runs[(algo, setting)])
                    if setting == "sync-1" and col > 0:
                        style = dict(color="k", linestyle="--", label="sync-1")
                    elif kind == "sync":
                        style = dict(
                            color=plt.get_cmap("viridis")(math.log2(value) / 5.5), marker="o", label=f"N={value}"
                        )
                    else:
                        style = dict(
                            color=plt.get_cmap("Reds")(0.35 + 0.65 * math.log2(value) / 3),
                            marker="^",
                            label=f"K={value}",
                        )
                    ax.plot([p["kl"] for p in curve], [p["win_rate"] for p in curve], markersize=3, **style)
                title = (
                    ("sync" if col == 0 else f"async, {CORRECTIONS[col - 1]}")
                    if (col < 2 or ALGORITHMS[algo]["corrections"])
                    else "(no correction modes)"
                )
                ax.set_title(f"{algo}: {title}", fontsize=9)
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
            row[0].set_ylabel("gold win-rate vs SFT")
        for ax in axes[-1]:
            ax.set_xlabel("KL(pi || pi_sft)")
        fig.tight_layout()
        fig.savefig(results_dir / f"{name}.png", dpi=110)
        plt.close(fig)
    if algos:  # the paper's Fig. 4: where each setting's final point lands, one panel per algorithm, then all three
        fig, axes = plt.subplots(1, len(algos) + 1, figsize=(4.2 * (len(algos) + 1), 3.4), squeeze=False)
        for ax, algo in zip(axes[0], algos):
            for setting in settings_of(algo, GATE_SYNC_N):
                if not runs.get((algo, setting)):
                    continue
                kind, value, correction = base.parse_setting(setting)
                kl = mean_ci([r["curve"][-1]["kl"] for r in runs[(algo, setting)]])
                win = mean_ci([r["curve"][-1]["win_rate"] for r in runs[(algo, setting)]])
                shade = plt.get_cmap("Blues" if correction == "behaviour" else "Reds")
                color = (
                    plt.get_cmap("viridis")(math.log2(value) / 5.5)
                    if kind == "sync"
                    else shade(0.35 + 0.65 * math.log2(value) / 3)
                )
                ax.errorbar(
                    kl[0],
                    win[0],
                    xerr=0 if math.isnan(kl[1]) else kl[1],
                    yerr=0 if math.isnan(win[1]) else win[1],
                    fmt="o" if kind == "sync" else "^",
                    color=color,
                    markersize=5,
                    capsize=2,
                    label=setting,
                )
            ax.set_title(f"{algo}: final points (mean ± 95% CI)", fontsize=9)
            ax.set_xlabel("final KL(pi || pi_sft)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        both = axes[0][-1]  # the paper's own panel: every algorithm's sync-N final points, N along each line
        for algo, marker in zip(algos, "osD^v"):
            points = [
                (n, *(sum(r["curve"][-1][key] for r in rs) / len(rs) for key in ("kl", "win_rate")))
                for n in GATE_SYNC_N
                for rs in [runs.get((algo, f"sync-{n}"))]
                if rs
            ]
            both.plot([kl for _, kl, _ in points], [win for _, _, win in points], marker=marker, label=algo)
            for n, kl, win in points:
                both.annotate(f"{n}", (kl, win), fontsize=6, xytext=(3, 3), textcoords="offset points")
        both.set_title("sync-N final points (means), N marked", fontsize=9)
        both.set_xlabel("final KL(pi || pi_sft)")
        both.grid(alpha=0.3)
        both.legend(fontsize=7)
        axes[0][0].set_ylabel("final gold win-rate vs SFT")
        fig.tight_layout()
        fig.savefig(results_dir / f"{name}_final.png", dpi=110)
        plt.close(fig)
    if gate:
        keys = sorted(gate)
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
        for ax, (algo, lr) in zip(axes[0], keys):
            curve = mean_curve(gate[(algo, lr)])
            x = [p["updates"] for p in curve]
            ax.plot(x, [p["proxy"] for p in curve], "o-", color="tab:blue", markersize=3, label="proxy (RM)")
            ax.set_xlabel("optimizer updates")
            ax.set_ylabel("proxy reward", color="tab:blue")
            twin = ax.twinx()
            twin.plot(x, [p["gold"] for p in curve], "s-", color="tab:red", markersize=3, label="gold")
            twin.set_ylabel("gold", color="tab:red")
            ax.set_title(f"{algo} sync-1, lr {lr:g}", fontsize=9)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(results_dir / f"{name}_gate.png", dpi=110)
        plt.close(fig)


def runnable(algo: str, setting: str):
    """DPO has no --off-policy-correction; the others' async settings name theirs."""
    kind, _, correction = base.parse_setting(setting)
    return kind == "sync" or bool(correction) == ALGORITHMS[algo]["corrections"]


def quick_settings(args: Args):
    """--quick: tiny everything (only fields left at their defaults shrink)."""
    args.settings = [s for s in (args.settings or QUICK_SETTINGS) if s in QUICK_SETTINGS]
    args.seeds = args.seeds[:1]
    replace_defaults(
        args,
        num_updates=4,
        eval_every_updates=2,
        num_train_problems=128,
        num_eval_problems=8,
        sft_max_steps=10,
        eval_samples=2,
        mini_batch_prompts=2,
        response_length=32,
        rm_samples=2,
        rm_epochs=1,
    )


def gate_settings(args: Args):
    """--gate NAME: the candidate's run length and learning rate. Applied after --quick, whose tiny run length then
    stands (only fields left at their defaults change)."""
    if args.gate not in GATE_CANDIDATES:
        sys.exit(f"error: unknown --gate {args.gate}; known: {list(GATE_CANDIDATES)}")
    cand = GATE_CANDIDATES[args.gate]
    replace_defaults(
        args, num_updates=cand["updates"], eval_every_updates=cand["eval_every"], learning_rates=[cand["lr"]]
    )


def replace_defaults(args: Args, **values):
    """Set the fields still at their defaults to these values: a flag given on the command line wins."""
    defaults = Args()
    for name, value in values.items():
        if getattr(args, name) == getattr(defaults, name):
            setattr(args, name, value)


def check(args: Args):
    """Bad flags fail in one line before anything is built."""
    unknown = [a for a in args.algorithms if a not in ALGORITHMS]
    if unknown:
        sys.exit(f"error: unknown --algorithms {unknown}; known: {list(ALGORITHMS)} (GRPO has no proxy)")
    known = {s for a in ALGORITHMS for s in settings_of(a, GATE_SYNC_N)}  # holds QUICK_SETTINGS
    if args.settings is not None and [s for s in args.settings if s not in known]:
        sys.exit(f"error: unknown --settings {[s for s in args.settings if s not in known]}; known: {sorted(known)}")
    if args.rm_samples < 2 or args.rm_samples % 2:
        sys.exit("error: --rm-samples must be even and >= 2 (disjoint pairs per problem)")
    empty = [
        flag
        for flag in ("--algorithms", "--seeds", "--learning-rates")
        if not getattr(args, flag[2:].replace("-", "_"))
    ]
    if empty and not (args.prep_only or args.report_only):  # the prep would be built for no run
        sys.exit(f"error: {' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty: no run to make")
    if min(args.num_updates, args.eval_every_updates) < 1:
        sys.exit(
            f"error: --num-updates and --eval-every-updates must be >= 1, got {args.num_updates} and "
            f"{args.eval_every_updates}"
        )
    for s in args.settings or [s for a in args.algorithms for s in settings_of(a, sweep_of(args.gate)[1])]:
        n = base.setting_flags(s)[1]
        # a round of N updates holds a whole number of evaluation periods, or the other way round (sync-128)
        nested = args.eval_every_updates % n == 0 or n % args.eval_every_updates == 0
        if not nested or args.num_updates % args.eval_every_updates or args.num_updates % n:
            sys.exit(
                f"error: --eval-every-updates {args.eval_every_updates} must be a multiple or a divisor of N of "
                f"{s}, and it and N must divide --num-updates {args.num_updates}"
            )


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        quick_settings(args)
    if args.gate is not None:
        gate_settings(args)
    check(args)
    results_dir = Path(args.results_dir)
    sweep_name, sync_n, _ = sweep_of(args.gate)
    (results_dir / sweep_name).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        invocation_start, durations, new_runs = time.time(), [], 0
        prep = prepare(args)
        if args.gate:  # the prep of the candidate's proxy: its stats and missing-EOS penalty
            prep = gate_rm(args, prep, GATE_CANDIDATES[args.gate]["rm"])[1]
        (results_dir / sweep_name / "prep.json").write_text(json.dumps(prep, indent=1))
        # seed-major: a partial sweep has one complete seed of every setting before it starts the next seed
        todo = [
            (seed, algo, lr, setting)
            for seed in ([] if args.prep_only else args.seeds)
            for algo in args.algorithms
            for lr in args.learning_rates
            for setting in args.settings or settings_of(algo, sync_n)
            if runnable(algo, setting)
        ]
        for seed, algo, lr, setting in todo:
            path = result_path(args, algo, setting, lr, seed)
            if path.exists() and not args.force:
                common.check_same_budget(path, base.budget(args, setting))
                continue
            if not may_start(args, path, invocation_start, durations, new_runs):
                break
            claimed = common.claim(Path(args.work_dir), f"{sweep_name}/{path.stem}")
            if claimed is None:
                print(f"== {path.stem}: being run by another invocation, skipped", flush=True)
                continue
            try:
                if path.exists() and not args.force:
                    continue
                miniature = gate_miniature(args, prep, args.gate, algo)[1] if args.gate else {}
                durations.append(run_one(args, prep, algo, setting, lr, seed, path, **miniature))
                new_runs += 1
            finally:
                claimed.unlink(missing_ok=True)
    print("\n".join(report(results_dir, args.gate)))
