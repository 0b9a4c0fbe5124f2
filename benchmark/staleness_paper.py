"""Staleness the paper's way: a proxy reward model over a continuous gold, gold win-rate against KL, one learning rate.
Noukhov et al. (2025), Sec. 3, in miniature on this machine.

    python benchmark/staleness_paper.py --prep-only                 # data, SFT policy, gold-labelled pairs, proxy RM
    python benchmark/staleness_paper.py --settings sync-1 --seeds 1 --learning-rates 1e-4 3e-4   # the gate runs
    python benchmark/staleness_paper.py --time-budget-hours 2       # the sweep, until 2 h are used; rerun to go on
    python benchmark/staleness_paper.py --report-only               # rebuild staleness_paper.md / .png
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
           prompt, ties half) versus KL to the SFT policy; a setting's score is the mean shortfall of its curve below
           sync-1's over the KL range every run of the algorithm reaches
GRPO trains on a verifier and has no proxy: it is reported apart, in benchmark/staleness.py's verifier sweep. Every run
is one subprocess of the real script; a run writes one result file, a rerun skips it, so the sweep spans sessions.
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

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tools"), str(REPO / "benchmark")]
import make_arithmetic as task  # noqa: E402  problems, the binary grader (SFT stopping rule) and the continuous gold
import staleness as base  # noqa: E402  the shared prep (data, tokenizer, SFT), sampler, KL, claims and budgets

# One rate for every algorithm, as in the paper: chosen by the gate runs on sync-1 (docs/benchmarks.md)
LEARNING_RATE = 1e-4
ALGORITHMS = {
    "dpo": dict(async_script="async_dpo.py", sync_script="sync_baselines/sync_dpo.py", corrections=False,
                flags=["--num-samples-per-prompt", "2", "--beta", "0.1"]),
    "rloo": dict(async_script="async_rloo.py", sync_script="sync_baselines/sync_rloo.py", corrections=True,
                 flags=["--num-samples-per-prompt", "2", "--kl-coef", "0.05"]),
    "ppo": dict(async_script="async_ppo.py", sync_script="sync_baselines/sync_ppo.py", corrections=True,
                flags=["--num-samples-per-prompt", "1", "--kl-coef", "0.05"]),
}
COMMON_FLAGS = ["--model-name-or-path", "{sft}", "--reward", "model", "--reward-model-path", "{rm}",
                "--dataset-path", "{prompts}", "--missing-eos-penalty", "{penalty}", "--max-prompt-tokens", "96",
                "--temperature", "0.7", "--torch-threads", "1", "--sample-every", "1000000", "--keep-checkpoints", "0"]
SYNC_N = (1, 4, 16, 32)
ASYNC_K = (1, 4, 8)
CORRECTIONS = ("paper", "behaviour")
QUICK_SETTINGS = ["sync-1", "sync-2", "async-1", "async-1-paper"]
# the settings whose scores rank the algorithms: the most off-policy of each kind, async under the paper's own loss
RANKED = ("sync-16", "sync-32", "async-4", "async-8")
KL_GRID = 20  # points of the common KL range at which curves are compared


def settings_of(algo: str):
    """sync-N, then async-K (DPO) or async-K-<correction>, in table order."""
    if ALGORITHMS[algo]["corrections"]:
        return [f"sync-{n}" for n in SYNC_N] + [f"async-{k}-{c}" for c in CORRECTIONS for k in ASYNC_K]
    return [f"sync-{n}" for n in SYNC_N] + [f"async-{k}" for k in ASYNC_K]


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
    """where result files (staleness_paper/), staleness_paper.md and its plots go"""
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
    """only rebuild staleness_paper.md and the plots from existing result files"""
    force: bool = False
    """rerun runs whose result file exists"""


# GOLD, WIN-RATE AND THE PROXY REWARD MODEL
def gold_scores(tokenizer, responses, answers, n):
    """The continuous gold of each response (prompt-major, n per prompt)."""
    return [task.gold_score(tokenizer.decode(r, skip_special_tokens=True), answers[i // n])
            for i, r in enumerate(responses)]


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


def train_reward_model(args: Args, tokenizer, train_set, eval_set, sft_dir: Path, out_dir: Path, log):
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
    return dict(rm_pairs=len(pairs), rm_tied_pairs=len(responses) // 2 - len(pairs), rm_train_pairs=len(train_pairs),
                rm_test_pair_accuracy=(chosen > rejected).float().mean().item(),
                rm_gold_correlation=torch.corrcoef(torch.stack([scores, gold_t]))[0, 1].item(),
                rm_score_mean=scores.mean().item(), missing_eos_penalty=penalty,
                rm_parameters=sum(p.numel() for p in rm.parameters()))


def evaluate(policy, sft, rm, tokenizer, eval_set, prep, args: Args, seed: int):
    """Gold, gold win-rate against the SFT samples, proxy reward and KL(pi || pi_sft) of T=0.7 samples of the held-out
    problems."""
    prompts, answers, n, eos = eval_set["prompts"], eval_set["answers"], args.eval_samples, tokenizer.eos_token_id
    samples = base.sample(policy, prompts, n, 0.7, args.response_length, eos, seed)
    repeated = [p for p in prompts for _ in range(n)]
    kls = [a - b for a, b in zip(base.response_logprob_sums(policy, repeated, samples, 0.7, eos),
                                 base.response_logprob_sums(sft, repeated, samples, 0.7, eos))]
    gold = gold_scores(tokenizer, samples, answers, n)
    proxy = proxy_rewards(rm, repeated, samples, eos, prep["missing_eos_penalty"], tokenizer.pad_token_id)
    return dict(win_rate=win_rate(gold, eval_set["sft_gold"], n, n), gold=sum(gold) / len(gold),
                proxy=sum(proxy) / len(proxy), kl=sum(kls) / len(kls),
                exact=sum(g == 1.0 for g in gold) / len(gold), eos_rate=sum(eos in s for s in samples) / len(samples),
                response_length=sum(map(len, samples)) / len(samples))


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
    return dict(prompts=prompts, answers=answers, sft_samples=samples,
                sft_gold=gold_scores(tokenizer, samples, answers, args.eval_samples))


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
            sys.exit(f"error: the prep in {work} was built with {prep.get('flags')}, this invocation asks for "
                     f"{wanted}; "
                     "pass another --work-dir (and --results-dir) or delete that folder")
        return prep
    start = time.time()
    sft_prep = base.prepare(args, task)  # data, tokenizer, SFT (prep.json; its own flags check)
    torch.set_num_threads(args.prep_threads)
    log = lambda msg: print(f"[prep {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    train = [json.loads(line) for line in (work / "data" / "train.jsonl").read_text().splitlines()]
    (work / "prompts").mkdir(exist_ok=True)  # what --reward model reads: the prompt text in the "query" field
    base.write_jsonl(work / "prompts" / "train.jsonl",
                     [{"query": base.PROMPT_TEMPLATE.format(question=p["question"])} for p in train])
    eval_set = load_eval_set(work, tokenizer, args)
    rm_start = time.time()
    rm_stats = train_reward_model(args, tokenizer, base.encode(tokenizer, train), eval_set, work / "sft", work / "rm",
                                  log)
    prep = dict(flags=wanted, **{k: v for k, v in sft_prep.items() if k not in ("flags", "initial_policy")},
                **rm_stats, rm_seconds=round(time.time() - rm_start))
    sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    rm = load_rm(work)
    # other draws than the reference's, as every run's update 0: the SFT policy's win-rate against itself, ~0.5
    prep["initial_policy"] = evaluate(sft, sft, rm, tokenizer, eval_set, prep, args, seed=999)
    prep["total_seconds"] = round(time.time() - start) + sft_prep["total_seconds"]
    prep_file.write_text(json.dumps(prep, indent=1))
    log(json.dumps({k: v for k, v in prep.items() if k != "sft_history"}))
    return prep


def load_rm(work: Path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(work / "rm", num_labels=1).eval()


# SWEEP: one subprocess per (algorithm, setting, learning rate, seed), then the evaluation of each of its checkpoints
def result_path(args: Args, algo: str, setting: str, learning_rate: float, seed: int):
    return Path(args.results_dir) / "staleness_paper" / f"{algo}__{setting}__lr{learning_rate:g}__seed{seed}.json"


def run_one(args: Args, prep, algo: str, setting: str, learning_rate: float, seed: int, path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    spec = ALGORITHMS[algo]
    script_key, n, flags_of_setting = base.setting_flags(setting)
    flags = COMMON_FLAGS + spec["flags"] + ["--learning-rate", f"{learning_rate:g}"]
    for key, value in {"{sft}": work / "sft", "{rm}": work / "rm", "{prompts}": work / "prompts",
                       "{penalty}": prep["missing_eos_penalty"]}.items():
        flags = [f.replace(key, str(value)) for f in flags]
    cwd = work / "runs" / path.stem
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / spec[script_key]), *flags, *flags_of_setting, "--seed", str(seed),
           *[str(x) for item in base.budget(args, setting).items() for x in item], "--output-dir", str(cwd / "model")]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    print(f"== {path.stem}: {' '.join(cmd)}", flush=True)
    start = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {path.stem} failed:\n{proc.stderr[-5000:]}")
    run_seconds = time.time() - start
    (metrics_path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    points = [(int(c.name.split("_")[1]) * n, c / "policy") for c in (cwd / "runs").glob("*/checkpoint_*")]
    points = [(0, work / "sft")] + sorted(points) + [(args.num_updates, cwd / "model")]
    torch.set_num_threads(args.prep_threads)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    sft, rm = AutoModelForCausalLM.from_pretrained(work / "sft").eval(), load_rm(work)
    eval_set = load_eval_set(work, tokenizer, args)
    # the evaluation seed differs per run seed, not per setting or point: all are compared on the same random draws
    curve = [dict(updates=u, **evaluate(AutoModelForCausalLM.from_pretrained(folder).eval(), sft, rm, tokenizer,
                                        eval_set, prep, args, seed=1000 + seed)) for u, folder in points]
    over_run = lambda key, how: how([m[key] for m in metrics]) if all(key in m for m in metrics) else None
    off_policy = dict(logprob_gap_mean=over_run("async/behaviour_learner_logprob_gap", lambda v: sum(v) / len(v)),
                      importance_ratio_max=over_run("policy/importance_ratio_max", max),
                      clipfrac_mean=over_run("policy/clipfrac", lambda v: sum(v) / len(v)))
    result = dict(algorithm=algo, setting=setting, learning_rate=learning_rate, seed=seed, command=cmd[1:],
                  curve=curve, off_policy=off_policy, episodes=metrics[-1]["episodes"],
                  train_scores=[m["objective/scores"] for m in metrics if "objective/scores" in m],
                  run_seconds=round(run_seconds, 1), eval_seconds=round(time.time() - start - run_seconds, 1),
                  date=time.strftime("%Y-%m-%d %H:%M"), machine=f"{platform.machine()}, {os.cpu_count()} cores",
                  commit=subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip())
    path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)
    print("   win " + " ".join(f"{p['win_rate']:.3f}" for p in curve) + "\n   proxy " +
          " ".join(f"{p['proxy']:.2f}" for p in curve) + f"\n   final KL {curve[-1]['kl']:.3f}  "
          f"({run_seconds:.0f}s run + {result['eval_seconds']:.0f}s eval)", flush=True)
    return time.time() - start


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


def load_results(results_dir: Path):
    """{(algorithm, setting): [runs at LEARNING_RATE]}, and {(algorithm, rate): [sync-1 runs]} (the gate)."""
    runs, gate = defaultdict(list), defaultdict(list)
    for path in sorted((results_dir / "staleness_paper").glob("*__*__lr*__seed*.json")):
        r = json.loads(path.read_text())
        if r["setting"] == "sync-1":
            gate[(r["algorithm"], r["learning_rate"])].append(r)
        if r["learning_rate"] == LEARNING_RATE:
            runs[(r["algorithm"], r["setting"])].append(r)
    return runs, gate


def scores_of(runs, algo):
    """Per setting, each seed's shortfall against the same seed's sync-1 run, over the KL range that every run of the
    algorithm reaches."""
    found = [s for s in settings_of(algo) + ["sync-2"] if runs.get((algo, s))]
    if not runs.get((algo, "sync-1")):
        return None, {}
    kl_max = min(reach(r["curve"]) for s in found for r in runs[(algo, s)])
    base_runs = {r["seed"]: r["curve"] for r in runs[(algo, "sync-1")]}
    return kl_max, {s: [shortfall(r["curve"], base_runs[r["seed"]], kl_max) for r in runs[(algo, s)]
                        if r["seed"] in base_runs] for s in found if s != "sync-1"}


def report(results_dir: Path):
    runs, gate = load_results(results_dir)
    prep_path = results_dir / "staleness_paper" / "prep.json"
    prep = json.loads(prep_path.read_text()) if prep_path.exists() else None
    ci = lambda mc: f"{mc[0]:+.3f} ± {mc[1]:.3f}" if not math.isnan(mc[1]) else f"{mc[0]:+.3f}"
    lines = ["Staleness under the paper's protocol (Noukhov et al. 2025, Sec. 3), in miniature: every algorithm "
             "optimises a proxy reward model trained on gold-labelled pairs; measured is the gold win-rate against the "
             "SFT policy (held-out problems, T=0.7, ties half) versus KL(pi || pi_sft).",
             "Produced by `python benchmark/staleness_paper.py` (see its docstring). Shortfall = the mean, over the KL "
             "range every run of the algorithm reaches, of sync-1's win-rate minus the setting's (same seed), then "
             "mean ± 95% CI over seeds; positive = staleness costs. A difference is *separated* when its CI excludes "
             "0.", ""]
    if prep:
        init = prep["initial_policy"]
        lines += [f"SFT policy: gold {init['gold']:.3f}, exact {init['exact']:.3f}, win-rate against itself "
                  f"{init['win_rate']:.3f}. Proxy RM: {prep['rm_pairs']:,} gold-labelled pairs "
                  f"({prep['rm_tied_pairs']:,}"
                  f" tied pairs dropped), held-out pair accuracy {prep['rm_test_pair_accuracy']:.3f}, correlation with "
                  f"gold on held-out SFT samples {prep['rm_gold_correlation']:.3f}; missing-EOS penalty "
                  f"{prep['missing_eos_penalty']}.", ""]
    if gate:
        lines += ["Gate (sync-1): the proxy reward and the gold along the run, per learning rate; the rate every "
                  f"algorithm uses is marked * ({LEARNING_RATE:g}). Over-optimisation shows as proxy rising while gold "
                  "peaks and falls.", "", "| algorithm | learning rate | seeds | proxy along the run | gold along the "
                  "run | win-rate along the run | final KL |", "|---|---|---|---|---|---|---|"]
        for (algo, lr), rs in sorted(gate.items()):
            mean = lambda key: " ".join(f"{sum(r['curve'][i][key] for r in rs) / len(rs):.3f}"
                                        for i in range(len(rs[0]["curve"])))
            lines.append(f"| {algo} | {lr:g}{' *' if lr == LEARNING_RATE else ''} | {len(rs)} | {mean('proxy')} | "
                         f"{mean('gold')} | {mean('win_rate')} | "
                         f"{sum(r['curve'][-1]['kl'] for r in rs) / len(rs):.2f} |")
    table, ranking, corrections = [], {}, []
    for algo in ALGORITHMS:
        kl_max, scores = scores_of(runs, algo)
        if kl_max is None:
            continue
        base_rs = runs[(algo, "sync-1")]
        peak = mean_ci([max(p["win_rate"] for p in r["curve"]) for r in base_rs])
        table.append(f"| {algo} | sync-1 | – | {peak[0]:.3f} | {kl_max:.2f} | {len(base_rs)} |")
        for setting, values in scores.items():
            peaks = [max(p["win_rate"] for p in r["curve"]) for r in runs[(algo, setting)]]
            table.append(f"| {algo} | {setting} | {ci(mean_ci(values))} | {mean_ci(peaks)[0]:.3f} | {kl_max:.2f} | "
                         f"{len(values)} |")
        named = lambda s: f"{s}-paper" if s.startswith("async") and ALGORITHMS[algo]["corrections"] else s
        per_seed = defaultdict(list)
        for s in RANKED:
            for r, v in zip([r for r in runs.get((algo, named(s)), []) if r["seed"] in
                             {b["seed"] for b in base_rs}], scores.get(named(s), [])):
                per_seed[r["seed"]].append(v)
        complete = [sum(v) / len(v) for v in per_seed.values() if len(v) == len(RANKED)]
        if complete:
            ranking[algo] = (mean_ci(complete), complete)
        for setting in [s for s in scores if s.endswith("-behaviour") and s.replace("-behaviour", "-paper") in scores]:
            # the two corrections on the same seeds: the difference of each seed's shortfalls
            behaviour, paper = ({r["seed"]: v for r, v in zip([r for r in runs[(algo, name)] if r["seed"] in
                                                                {b["seed"] for b in base_rs}], scores[name])}
                                for name in (setting, setting.replace("-behaviour", "-paper")))
            paired = [behaviour[seed] - paper[seed] for seed in behaviour if seed in paper]
            corrections.append(f"| {algo} | {setting.split('-')[1]} | {ci(mean_ci(paired))} | {len(paired)} |")
    if table:
        lines += ["", "| algorithm | setting | shortfall below sync-1 | peak win-rate | KL range | seeds |",
                  "|---|---|---|---|---|---|"] + table
    if ranking:
        order = sorted(ranking, key=lambda a: ranking[a][0][0])
        lines += ["", f"Ranking by the mean shortfall over {', '.join(RANKED)} (async under `paper`), most robust "
                  "first; the paper's finding is online DPO most robust, then PPO and RLOO.", "",
                  "| rank | algorithm | mean shortfall | seeds |", "|---|---|---|---|"]
        lines += [f"| {i + 1} | {a} | {ci(ranking[a][0])} | {len(ranking[a][1])} |" for i, a in enumerate(order)]
        lines += ["", "Differences between algorithms (Welch's t on the per-seed mean shortfalls; separated when "
                  "|t| > 2.3, about p < 0.05 at these seed counts):", ""]
        for i, a in enumerate(order):
            for b in order[i + 1 :]:
                lines.append(f"- {a} vs {b}: {ranking[a][0][0] - ranking[b][0][0]:+.3f}, t = "
                             f"{welch_t(ranking[a][1], ranking[b][1]):.2f}")
    if corrections:
        lines += ["", "`behaviour` against `paper` at the same K, paired by seed: the shortfall under `behaviour` minus "
                  "the shortfall under `paper` (mean ± 95% CI over seeds); negative = `behaviour` keeps more gold "
                  "win-rate at matched KL.", "", "| algorithm | K | behaviour − paper | seeds |",
                  "|---|---|---|---|", *corrections]
    (results_dir / "staleness_paper.md").write_text("\n".join(lines) + "\n")
    if runs or gate:
        plot(runs, gate, results_dir)
    return lines


def welch_t(a, b):
    var = lambda x: sum((v - sum(x) / len(x)) ** 2 for v in x) / (len(x) - 1) if len(x) > 1 else float("nan")
    se = math.sqrt(var(a) / len(a) + var(b) / len(b))
    return (sum(a) / len(a) - sum(b) / len(b)) / se if se > 0 else float("nan")


def mean_curve(rs):
    return [{k: sum(p[k] for p in points) / len(points) for k in ("updates", "kl", "win_rate", "gold", "proxy")}
            for points in zip(*[r["curve"] for r in rs])]


def plot(runs, gate, results_dir: Path):
    """staleness_paper.png: win-rate vs KL, one row per algorithm (sync N | async under paper | under behaviour);
    staleness_paper_gate.png: proxy and gold along the sync-1 runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ALGORITHMS if any(k[0] == a for k in runs)]
    if algos:
        fig, axes = plt.subplots(len(algos), 3, figsize=(12, 3.0 * len(algos)), squeeze=False, sharey="row")
        for row, algo in zip(axes, algos):
            for col, ax in enumerate(row):
                for setting in settings_of(algo) + ["sync-2"]:
                    kind, value, correction = base.parse_setting(setting)
                    column = 0 if kind == "sync" else 1 + CORRECTIONS.index(correction or "paper")
                    if not runs.get((algo, setting)) or (column != col and setting != "sync-1"):
                        continue
                    curve = mean_curve(runs[(algo, setting)])
                    if setting == "sync-1" and col > 0:
                        style = dict(color="k", linestyle="--", label="sync-1")
                    elif kind == "sync":
                        style = dict(color=plt.get_cmap("viridis")(math.log2(value) / 5.5), marker="o",
                                     label=f"N={value}")
                    else:
                        style = dict(color=plt.get_cmap("Reds")(0.35 + 0.65 * math.log2(value) / 3), marker="^",
                                     label=f"K={value}")
                    ax.plot([p["kl"] for p in curve], [p["win_rate"] for p in curve], markersize=3, **style)
                title = ("sync" if col == 0 else f"async, {CORRECTIONS[col - 1]}") if (
                    col < 2 or ALGORITHMS[algo]["corrections"]) else "(no correction modes)"
                ax.set_title(f"{algo}: {title}", fontsize=9)
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
            row[0].set_ylabel("gold win-rate vs SFT")
        for ax in axes[-1]:
            ax.set_xlabel("KL(pi || pi_sft)")
        fig.tight_layout()
        fig.savefig(results_dir / "staleness_paper.png", dpi=110)
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
        fig.savefig(results_dir / "staleness_paper_gate.png", dpi=110)
        plt.close(fig)


def runnable(algo: str, setting: str):
    """DPO has no --off-policy-correction; the others' async settings name theirs."""
    kind, _, correction = base.parse_setting(setting)
    return kind == "sync" or bool(correction) == ALGORITHMS[algo]["corrections"]


def quick_settings(args: Args):
    """--quick: tiny everything (only fields left at their defaults shrink)."""
    args.settings = [s for s in (args.settings or QUICK_SETTINGS) if s in QUICK_SETTINGS]
    args.seeds = args.seeds[:1]
    quick = dict(num_updates=4, eval_every_updates=2, num_train_problems=128, num_eval_problems=8, sft_max_steps=10,
                 eval_samples=2, mini_batch_prompts=2, response_length=32, rm_samples=2, rm_epochs=1)
    defaults = Args()
    for name, value in quick.items():
        if getattr(args, name) == getattr(defaults, name):
            setattr(args, name, value)


def check(args: Args):
    """Bad flags fail in one line before anything is built."""
    unknown = [a for a in args.algorithms if a not in ALGORITHMS]
    if unknown:
        sys.exit(f"error: unknown --algorithms {unknown}; known: {list(ALGORITHMS)} (GRPO: benchmark/staleness.py)")
    known = {s for a in ALGORITHMS for s in settings_of(a)} | set(QUICK_SETTINGS)
    if args.settings is not None and [s for s in args.settings if s not in known]:
        sys.exit(f"error: unknown --settings {[s for s in args.settings if s not in known]}; known: {sorted(known)}")
    if args.rm_samples < 2 or args.rm_samples % 2:
        sys.exit("error: --rm-samples must be even and >= 2 (disjoint pairs per problem)")
    for s in args.settings or [s for a in args.algorithms for s in settings_of(a)]:
        n = base.setting_flags(s)[1]
        if args.eval_every_updates % n or args.num_updates % args.eval_every_updates:
            sys.exit(f"error: --eval-every-updates {args.eval_every_updates} must be a multiple of N of {s} and "
                     f"divide --num-updates {args.num_updates}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        quick_settings(args)
    check(args)
    results_dir = Path(args.results_dir)
    (results_dir / "staleness_paper").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        invocation_start, durations, new_runs = time.time(), [], 0
        prep = prepare(args)
        (results_dir / "staleness_paper" / "prep.json").write_text(json.dumps(prep, indent=1))
        # seed-major: a partial sweep has one complete seed of every setting before it starts the next seed
        todo = [(seed, algo, lr, setting) for seed in ([] if args.prep_only else args.seeds) for algo in args.algorithms
                for lr in args.learning_rates for setting in args.settings or settings_of(algo)
                if runnable(algo, setting)]
        for seed, algo, lr, setting in todo:
            path = result_path(args, algo, setting, lr, seed)
            if path.exists() and not args.force:
                base.check_same_budget(path, args, setting)
                continue
            if args.max_runs is not None and new_runs >= args.max_runs:
                break
            expected = max(durations) if durations else 0.0
            if args.time_budget_hours is not None and \
                    time.time() - invocation_start + expected > 3600 * args.time_budget_hours:
                print(f"== time budget reached: not starting {path.stem}")
                break
            claimed = base.claim(Path(args.work_dir), path.stem)
            if claimed is None:
                print(f"== {path.stem}: being run by another invocation, skipped", flush=True)
                continue
            try:
                if path.exists() and not args.force:
                    continue
                durations.append(run_one(args, prep, algo, setting, lr, seed, path))
                new_runs += 1
            finally:
                claimed.unlink(missing_ok=True)
    print("\n".join(report(results_dir)))
