"""Staleness: how much does off-policy data cost each algorithm, and which correction buys it back? The paper's
Sec. 3 protocol at CPU scale, with a gold reward that can still rise.

    python benchmark/staleness.py --prep-only                          # build the miniature task once (~5 min, idle)
    python benchmark/staleness.py --algorithms grpo_gsm8k --settings sync-1 --seeds 1 --learning-rates 1e-4 3e-4
    python benchmark/staleness.py --time-budget-hours 2                # run the sweep until 2 h are used, then stop
    python benchmark/staleness.py --report-only                        # rebuild staleness.md / .png from result files
    python benchmark/staleness.py --quick --algorithms dpo --results-dir D --work-dir W   # the test suite's smoke run

Paper (Noukhovitch et al., 2025, Sec. 3): train with N mini-batches per generation round (N-1 of the N updates use data
from an older policy) and compare gold reward against KL to the initial policy. As in the paper's code (where a
generation batch is num_mini_batches x the mini-batch), the mini-batch and the number of optimizer updates are the same
for every setting: sync-N generates N mini-batches per round and runs 1/N as many rounds, so only off-policyness varies,
not the number, size or learning-rate schedule of the updates. async-K trains on batches made K policy versions ago,
under each of the scripts' three `--off-policy-correction` modes (DPO has no ratio and so no correction).

  task     one-step GSM8K-format arithmetic word problems from tools/make_arithmetic.py; gold = the task's grader
           (the same final-number rule as the scripts' verifier, checked in tests). Two-step problems (difficulty 2)
           were tried first: RL did not raise this tiny model's held-out accuracy there at any learning rate tried
  policy   a 0.4M-parameter Llama trained here by SFT and stopped early, at about 0.2 greedy held-out accuracy, so
           that RL has room to raise it
  reward   every algorithm trains on the scripts' own verifier (`--reward verifier`): the gold signal cannot be
           over-optimised the way the earlier proxy reward model was
  curves   every run saves a checkpoint every --eval-every-updates updates (`--keep-checkpoints 0`); each one is
           evaluated here afterwards, so a run is a gold-vs-updates and a gold-vs-KL curve
Every run is one subprocess of the real sync or async script. Each run writes one result file; a rerun skips finished
runs, so the sweep can be done in chunks across sessions, and by several invocations at once (each run is claimed
first; see `common.claim`).
"""

import json
import math
import os
import platform
import random
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import tyro

import common

REPO = common.REPO
task = common.arithmetic_task()  # the problem generator and its gold grader

PROMPT_TEMPLATE = "Question: {question}\nAnswer:"

# ONE table of every per-algorithm choice; {sft} and {data} are filled in at run time. All four sample 4 responses per
# prompt (the paper's GSM8K online DPO and RLOO use k = 4), so a mini-batch of P prompts is 4P episodes for every
# algorithm; GRPO always grades with the verifier, the others are told to. Learning rates: from the sweep on sync-1,
# seed 1 (docs/benchmarks.md), the highest rate whose held-out gold still rises late in the budget without collapsing
# (GRPO collapsed at 1e-4: KL 74, gold 0.16).
VERIFIER = ["--dataset-path", "{data}", "--prompt-template", PROMPT_TEMPLATE, "--num-samples-per-prompt", "4"]
ALGORITHMS = {
    "dpo": dict(
        async_script="async_dpo.py",
        sync_script="sync_baselines/sync_dpo.py",
        learning_rate=1e-4,
        flags=["--reward", "verifier", "--beta", "0.1"],
        corrections=False,
    ),
    "rloo": dict(
        async_script="async_rloo.py",
        sync_script="sync_baselines/sync_rloo.py",
        learning_rate=1e-4,
        flags=["--reward", "verifier", "--kl-coef", "0.05"],
        corrections=True,
    ),
    "ppo": dict(
        async_script="async_ppo.py",
        sync_script="sync_baselines/sync_ppo.py",
        learning_rate=1e-4,
        flags=["--reward", "verifier", "--kl-coef", "0.05"],
        corrections=True,
    ),
    "grpo_gsm8k": dict(
        async_script="async_grpo_gsm8k.py",
        sync_script="sync_baselines/sync_grpo_gsm8k.py",
        learning_rate=3e-5,
        flags=["--num-eval-prompts", "0"],
        corrections=True,
    ),  # evaluated here
}
# flags every run gets (prompt/response sizes fit the generated problems; no sample tables: they cost time)
COMMON_FLAGS = [
    "--model-name-or-path",
    "{sft}",
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
    "--weight-decay",
    "0.01",
]  # the AdamW default every committed run of this sweep was made with
# the paper's off-policyness knobs: sync with N mini-batches per round (N=1 is fully on-policy), async with K steps of
# lag under each correction
SYNC_N = (1, 4, 16, 32)
ASYNC_K = (1, 2, 4, 8)
CORRECTIONS = ("paper", "behaviour", "decoupled")
QUICK_SETTINGS = ["sync-1", "sync-2", "async-1", "async-1-decoupled"]


def settings_of(algo: str):
    """sync-N, then async-K (DPO) or async-K-<correction> (the others), in table order."""
    if ALGORITHMS[algo]["corrections"]:
        return [f"sync-{n}" for n in SYNC_N] + [f"async-{k}-{c}" for c in CORRECTIONS for k in ASYNC_K]
    return [f"sync-{n}" for n in SYNC_N] + [f"async-{k}" for k in ASYNC_K]


def parse_setting(setting: str):
    """'sync-4' -> ('sync', 4, None); 'async-2-decoupled' -> ('async', 2, 'decoupled'); 'async-2' -> ('async', 2,
    None)."""
    kind, value, *correction = setting.split("-")
    return kind, int(value), (correction[0] if correction else None)


@dataclass
class Args:
    algorithms: List[str] = field(default_factory=lambda: list(ALGORITHMS))
    """algorithms to run"""
    settings: Optional[List[str]] = None
    """settings to run (None: all of each algorithm): sync-N (N mini-batches per round), async-K (DPO) and
    async-K-<paper|behaviour|decoupled> (K steps of lag under that --off-policy-correction)"""
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the RL runs (the prep is seeded separately and shared)"""
    learning_rates: Optional[List[float]] = None
    """learning rates to run (None: each algorithm's own from ALGORITHMS); result files of other rates are kept apart,
    for the sweep that chose them"""
    mini_batch_prompts: int = 16
    """prompts per optimizer update, the same for every setting (a generation round of sync-N holds N mini-batches)"""
    num_updates: int = 256
    """optimizer updates per run, the same for every setting; must be divisible by every N"""
    eval_every_updates: int = 32
    """evaluate the policy every this many updates (a multiple of every N), so each run is a curve"""
    response_length: int = 48
    """maximum new tokens per response (worked solutions are ~22 tokens + EOS at difficulty 1, 35 at 2)"""
    difficulty: int = 1
    """arithmetic difficulty: operations per problem (operands up to 10*difficulty-1)"""
    num_train_problems: int = 4096
    """generated training problems (SFT and RL prompts)"""
    num_eval_problems: int = 256
    """held-out problems for every evaluation (disjoint from the training problems)"""
    sft_max_steps: int = 3000
    """SFT optimizer steps at most (batch 32)"""
    sft_target_accuracy: float = 0.2
    """SFT stops at the first check whose greedy held-out accuracy reaches this: competent, with headroom"""
    eval_samples: int = 4
    """samples per held-out problem (temperature 0.7) for the gold reward and the KL"""
    prep_threads: int = 2
    """torch threads for the prep and the evaluations (the RL runs use --torch-threads 1 per role)"""
    results_dir: str = str(REPO / "benchmark" / "results" / "staleness")
    """where result files, staleness.md and staleness*.png go"""
    work_dir: str = str(REPO / "benchmark" / "work" / "staleness")
    """scratch space (git-ignored): data, tokenizer, SFT policy, run folders"""
    max_runs: Optional[int] = None
    """stop after this many new runs (None: no limit)"""
    time_budget_hours: Optional[float] = None
    """do not start a run that would likely end after this many hours of this invocation (None: no limit)"""
    quick: bool = False
    """smoke mode for the test suite: tiny prep, 4 updates, 1 seed, settings sync-1, sync-2, async-1(-decoupled)"""
    prep_only: bool = False
    """build (or load) the prep and stop"""
    report_only: bool = False
    """only rebuild staleness.md and the plots from existing result files"""
    force: bool = False
    """rerun runs whose result file exists"""


# PREP: data, tokenizer, SFT policy. Built once; prep.json records what was measured.
def write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_data(args: Args, task, data_dir: Path):
    """Train / held-out problems (disjoint questions) as GSM8K-format JSONL, what the scripts' --dataset-path reads."""
    train = task.make_arithmetic_problems(args.num_train_problems, args.difficulty, seed=0)
    seen = {p["question"] for p in train}
    test = [
        p
        for p in task.make_arithmetic_problems(4 * args.num_eval_problems, args.difficulty, seed=1)
        if p["question"] not in seen
    ][: args.num_eval_problems]
    data_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(data_dir / "train.jsonl", train)
    write_jsonl(data_dir / "test.jsonl", test)
    return train, test


def train_tokenizer(problems):
    """Byte-level BPE trained on the generated corpus (as tools/make_tiny_models.py); pad == EOS like Pythia and SmolLM2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [PROMPT_TEMPLATE.format(question=p["question"]) + " " + p["answer"] for p in problems]
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def encode(tokenizer, problems):
    """Prompt ids (tokenized alone, exactly as the RL scripts tokenize the prompt text) and reference answers."""
    prompts = tokenizer([PROMPT_TEMPLATE.format(question=p["question"]) for p in problems])["input_ids"]
    return prompts, [p["answer"].split("####")[-1].strip() for p in problems]


def pad_right(rows, pad_id):
    """Right-padded ids and attention mask (a causal model never looks at the padding to the right)."""
    import torch

    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def sample(model, prompts, n, temperature, max_new, eos_id, seed, chunk=512):
    """n responses per prompt (prompt-major), each ending at its first EOS; greedy if temperature == 0.

    A plain KV-cache loop rather than `generate`: no hidden top-k / top-p defaults, so samples come from exactly
    softmax(logits / T), the distribution whose logprobs the KL uses. Prompts are left-padded with explicit positions,
    so a padded prompt is read exactly as it would be alone.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    rows = [p for p in prompts for _ in range(n)]
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), chunk):
            batch = rows[start : start + chunk]
            width = max(map(len, batch))
            ids = torch.tensor([[eos_id] * (width - len(r)) + r for r in batch])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            result = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            done = torch.zeros(len(batch), dtype=torch.bool)
            tokens = []
            for _ in range(max_new):
                logits = result.logits[:, -1].float()
                if temperature == 0:
                    nxt = logits.argmax(-1)
                else:
                    nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator).squeeze(1)
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                tokens.append(nxt)
                done |= nxt == eos_id
                if done.all():
                    break
                mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], 1)
                positions = positions[:, -1:] + 1
                result = model(
                    input_ids=nxt[:, None],
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=result.past_key_values,
                    use_cache=True,
                )
            for seq in torch.stack(tokens, 1).tolist():
                out.append(seq[: seq.index(eos_id) + 1] if eos_id in seq else seq)
    return out


def response_token_logprobs(model, prompts, responses, temperature, pad_id, chunk=64):
    """Per response, log softmax(logits / T)[y_t] of each of its tokens (the scripts' `token_logprobs`)."""
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(prompts), chunk):
            pairs = list(zip(prompts[s : s + chunk], responses[s : s + chunk]))
            ids, mask = pad_right([p + r for p, r in pairs], pad_id)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            out.extend(lp[i, len(p) - 1 : len(p) - 1 + len(r)] for i, (p, r) in enumerate(pairs))  # t scores t+1
    return out


def response_logprob_sums(model, prompts, responses, temperature, pad_id, chunk=64):
    """sum_t log softmax(logits / T)[y_t] over each response's tokens (the scripts' `token_logprobs`, summed)."""
    return [t.sum().item() for t in response_token_logprobs(model, prompts, responses, temperature, pad_id, chunk)]


def grade(task, tokenizer, responses, answers, n):
    return [task.grade(tokenizer.decode(r, skip_special_tokens=True), answers[i // n]) for i, r in enumerate(responses)]


def evaluate_policy(policy, sft, tokenizer, task, eval_set, args: Args, seed: int):
    """Gold reward (verifier accuracy) of T=0.7 samples and of greedy answers, and KL(pi || pi_sft) on pi's samples."""
    prompts, answers = eval_set
    n, eos = args.eval_samples, tokenizer.eos_token_id
    samples = sample(policy, prompts, n, 0.7, args.response_length, eos, seed)
    greedy = sample(policy, prompts, 1, 0.0, args.response_length, eos, seed)
    repeated = [p for p in prompts for _ in range(n)]
    # KL estimated on the policy's own samples, at the sampling temperature: E_y~pi [log pi(y) - log pi_sft(y)]
    kls = [
        a - b
        for a, b in zip(
            response_logprob_sums(policy, repeated, samples, 0.7, eos),
            response_logprob_sums(sft, repeated, samples, 0.7, eos),
        )
    ]
    gold = grade(task, tokenizer, samples, answers, n)
    return dict(
        gold_reward=sum(gold) / len(gold),
        greedy_accuracy=sum(grade(task, tokenizer, greedy, answers, 1)) / len(greedy),
        kl=sum(kls) / len(kls),
        eos_rate=sum(eos in s for s in samples) / len(samples),
        response_length=sum(map(len, samples)) / len(samples),
    )


def train_sft(args: Args, tokenizer, task, train, eval_set, out_dir: Path, log):
    """SFT of a small Llama on prompt + worked answer + EOS, stopped once greedy held-out accuracy reaches the
    target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention needs head_dim >= 32; tied embeddings keep the tiny model tiny
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    prompts, _ = encode(tokenizer, train)
    answers = tokenizer([" " + p["answer"] for p in train])["input_ids"]
    examples = [(p, a + [tokenizer.eos_token_id]) for p, a in zip(prompts, answers)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    check_every = 10 if args.quick else 25  # often enough to stop near the target: the accuracy climbs fast
    rng, accuracy, step, history = random.Random(0), 0.0, 0, []
    for step in range(1, args.sft_max_steps + 1):
        batch = rng.sample(examples, 32)
        ids, mask = pad_right([p + a for p, a in batch], tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)  # the loss is on the answer and its EOS only, not on the prompt
        for i, (p, a) in enumerate(batch):
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        for g in optimizer.param_groups:  # short warm-up, then constant
            g["lr"] = 2e-3 * min(1.0, step / 100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % check_every == 0 or step == args.sft_max_steps:
            model.eval()
            greedy = sample(model, eval_set[0], 1, 0.0, args.response_length, tokenizer.eos_token_id, 0)
            accuracy = sum(grade(task, tokenizer, greedy, eval_set[1], 1)) / len(greedy)
            model.train()
            history.append((step, round(loss.item(), 4), accuracy))
            log(f"SFT step {step}: loss {loss.item():.3f}, greedy held-out accuracy {accuracy:.3f}")
            if accuracy >= args.sft_target_accuracy:
                break
    model.eval().save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model, dict(
        sft_steps=step,
        sft_greedy_accuracy=accuracy,
        sft_history=history,
        policy_parameters=sum(p.numel() for p in model.parameters()),
    )


PREP_FLAGS = (
    "difficulty",
    "num_train_problems",
    "num_eval_problems",
    "sft_max_steps",
    "sft_target_accuracy",
    "eval_samples",
    "response_length",
)


def prepare(args: Args, task):
    """Build data, tokenizer and SFT policy once; returns the prep numbers (from prep.json if built)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    prep_file = work / "prep.json"
    wanted = {name: getattr(args, name) for name in PREP_FLAGS}
    if prep_file.exists():
        prep = json.loads(prep_file.read_text())
        # the cache is keyed by folder: a prep built with other flags must not be reused silently
        if prep.get("flags") != wanted:
            sys.exit(
                f"error: the prep in {work} was built with {prep.get('flags')}, "
                f"this invocation asks for {wanted}; "
                "pass another --work-dir (and --results-dir) or delete that folder"
            )
        return prep
    torch.set_num_threads(args.prep_threads)
    log = lambda msg: print(f"[prep {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    start = time.time()
    train, test = make_data(args, task, work / "data")
    tokenizer = train_tokenizer(train)
    eval_set = encode(tokenizer, test)
    log(
        f"{len(train)} train / {len(test)} held-out problems, vocabulary {len(tokenizer)}, "
        f"prompt ~{sum(map(len, eval_set[0])) / len(test):.0f} tokens"
    )
    _, sft_stats = train_sft(args, tokenizer, task, train, eval_set, work / "sft", log)
    sft_time = time.time() - start
    # the starting point of every run, measured exactly as the runs are (KL to itself is 0 by definition)
    sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    initial = evaluate_policy(sft, sft, AutoTokenizer.from_pretrained(work / "sft"), task, eval_set, args, seed=0)
    prep = dict(
        flags=wanted,
        difficulty=args.difficulty,
        num_train_problems=len(train),
        num_eval_problems=len(test),
        vocab_size=len(tokenizer),
        **sft_stats,
        initial_policy=initial,
        sft_seconds=round(sft_time),
        total_seconds=round(time.time() - start),
        threads=args.prep_threads,
        machine=f"{platform.machine()}, {os.cpu_count()} cores (shared)",
    )
    prep_file.write_text(json.dumps(prep, indent=1))
    log(json.dumps({k: v for k, v in prep.items() if k != "sft_history"}))
    return prep


# SWEEP: one subprocess per (algorithm, setting, learning rate, seed), then the evaluation of each of its checkpoints
def setting_flags(setting: str):
    """The script (sync or async twin), the number N of mini-batches per generation round, and the flags."""
    kind, value, correction = parse_setting(setting)
    if kind == "sync":
        return "sync_script", value, ["--num-mini-batches", str(value)]
    return (
        "async_script",
        1,
        ["--async-steps", str(value)] + (["--off-policy-correction", correction] if correction else []),
    )


def budget(args: Args, setting: str):
    """The paper's protocol: N mini-batches of a fixed size per generation round, num_updates / N rounds; a checkpoint
    every eval_every_updates updates, or every round where a round holds more updates (issue 54's sync-128)."""
    n = setting_flags(setting)[1]
    return {
        "--prompts-per-step": n * args.mini_batch_prompts,
        "--num-learner-steps": args.num_updates // n,
        "--response-length": args.response_length,
        "--save-every": max(1, args.eval_every_updates // n),
    }


def result_path(args: Args, algo: str, setting: str, learning_rate: float, seed: int):
    return Path(args.results_dir) / "runs" / f"{algo}__{setting}__lr{learning_rate:g}__seed{seed}.json"


def run_one(args: Args, task, algo: str, setting: str, learning_rate: float, seed: int, path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    spec = ALGORITHMS[algo]
    script_key, n, flags_of_setting = setting_flags(setting)
    # str.replace, not str.format: --prompt-template holds a literal {question}
    flags = COMMON_FLAGS + VERIFIER + spec["flags"] + ["--learning-rate", f"{learning_rate:g}"]
    for key, value in {"{sft}": work / "sft", "{data}": work / "data"}.items():
        flags = [f.replace(key, str(value)) for f in flags]
    cwd = work / "runs" / path.stem
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [
        sys.executable,
        str(REPO / spec[script_key]),
        *flags,
        *flags_of_setting,
        "--seed",
        str(seed),
        *[str(x) for item in budget(args, setting).items() for x in item],
        "--output-dir",
        str(cwd / "model"),
    ]
    print(f"== {path.stem}: {' '.join(cmd)}", flush=True)
    start = time.time()
    common.run_script(cmd, cwd, path.stem)
    run_seconds = time.time() - start
    (metrics_path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    # the curve: the SFT policy (update 0), every checkpoint, the final policy
    points = [(int(c.name.split("_")[1]) * n, c / "policy") for c in (cwd / "runs").glob("*/checkpoint_*")]
    points = [(0, work / "sft")] + sorted(points) + [(args.num_updates, cwd / "model")]
    torch.set_num_threads(args.prep_threads)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    test = [json.loads(line) for line in (work / "data" / "test.jsonl").read_text().splitlines()]
    curve = []
    for updates, folder in points:
        policy = AutoModelForCausalLM.from_pretrained(folder).eval()
        # the evaluation seed differs per run seed, not per setting or point: all are compared on the same random draws
        curve.append(
            dict(
                updates=updates,
                **evaluate_policy(policy, sft, tokenizer, task, encode(tokenizer, test), args, seed=1000 + seed),
            )
        )
    # how far off-policy the data really were, over the whole run: async's engine-vs-learner logprob gap (before each
    # step's first update: K versions of drift), and the largest importance ratio (sync-N's drift within a round)
    over_run = lambda key, how: how([m[key] for m in metrics]) if all(key in m for m in metrics) else None
    off_policy = dict(
        logprob_gap_mean=over_run("async/behaviour_learner_logprob_gap", lambda v: sum(v) / len(v)),
        logprob_gap_max=over_run("async/behaviour_learner_logprob_gap", max),
        importance_ratio_max=over_run("policy/importance_ratio_max", max),
        clipfrac_mean=over_run("policy/clipfrac", lambda v: sum(v) / len(v)),
    )
    result = dict(
        algorithm=algo,
        setting=setting,
        learning_rate=learning_rate,
        seed=seed,
        command=cmd[1:],
        **{k: v for k, v in curve[-1].items() if k != "updates"},
        curve=curve,
        off_policy=off_policy,
        episodes=metrics[-1]["episodes"],
        run_seconds=round(run_seconds, 1),
        eval_seconds=round(time.time() - start - run_seconds, 1),
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        final_metrics=metrics[-1],
    )
    path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)  # the run folder and its checkpoints are not needed any more
    print(
        "   gold " + " ".join(f"{p['gold_reward']:.3f}" for p in curve) + f"  final KL {curve[-1]['kl']:.3f}  "
        f"({run_seconds:.0f}s run + {result['eval_seconds']:.0f}s eval)",
        flush=True,
    )
    return time.time() - start


# REPORT: rebuilt from the result files alone
def mean_std(values):
    m = sum(values) / len(values)
    return m, (math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan"))


def gold_at_kl(curve, kl: float):
    """Gold where the run's curve (in update order) first reaches this KL, interpolated linearly between its points."""
    for a, b in zip(curve, curve[1:]):
        if a["kl"] <= kl <= b["kl"]:
            t = (kl - a["kl"]) / (b["kl"] - a["kl"]) if b["kl"] > a["kl"] else 1.0
            return a["gold_reward"] + t * (b["gold_reward"] - a["gold_reward"])
    return float("nan")


def mean_curve(runs):
    """Seed-mean gold and KL at each evaluated update count (every seed of a setting is evaluated at the same ones)."""
    return [
        dict(
            updates=points[0]["updates"],
            gold_reward=mean_std([p["gold_reward"] for p in points])[0],
            kl=mean_std([p["kl"] for p in points])[0],
        )
        for points in zip(*[r["curve"] for r in runs])
    ]


def load_results(results_dir: Path):
    """{(algorithm, setting): [runs at the algorithm's own learning rate]}, and every sync-1 run (the rate sweep)."""
    runs, rate_sweep = defaultdict(list), defaultdict(list)
    for path in sorted((results_dir / "runs").glob("*__*__lr*__seed*.json")):
        r = json.loads(path.read_text())
        if r["algorithm"] not in ALGORITHMS:
            continue
        if r["setting"] == "sync-1":
            rate_sweep[(r["algorithm"], r["learning_rate"])].append(r)
        if r["learning_rate"] == ALGORITHMS[r["algorithm"]]["learning_rate"]:
            runs[(r["algorithm"], r["setting"])].append(r)
    for (algo, setting), rs in runs.items():
        if len({(r["episodes"], len(r["curve"])) for r in rs}) > 1:
            sys.exit(f"error: {algo} {setting} has result files of different budgets in {results_dir / 'runs'}")
    return runs, rate_sweep


def report(results_dir: Path):
    """Rebuild staleness.md, staleness.png (gold vs KL) and staleness_updates.png (gold vs updates)."""
    runs, rate_sweep = load_results(results_dir)
    prep_path = results_dir / "runs" / "prep.json"
    prep = json.loads(prep_path.read_text()) if prep_path.exists() else None
    fmt = lambda ms: f"{ms[0]:.3f} ± {ms[1]:.3f}" if not math.isnan(ms[1]) else f"{ms[0]:.3f}"
    lines = [
        "Staleness with a verifiable reward: every algorithm trains on the verifier that also scores it (reward = "
        "gold), so nothing can be over-optimised and this does not test the paper's Sec. 3 question (a proxy "
        "reward model, gold win-rate against KL): that is benchmark/staleness_paper.py (staleness_paper/first.md). "
        "Gold = verifier accuracy of temperature-0.7 samples on held-out problems; KL = mean over the policy's "
        "own samples of sum_t log pi - log pi_sft (T=0.7).",
        "sync-N: N mini-batches per generation round; async-K[-correction]: batches generated K policy versions "
        "ago, trained with that --off-policy-correction. Gold at matched KL: each run's gold where its curve "
        "first reaches the largest KL that every run of the algorithm reaches (linear between evaluations).",
        "Produced by `python benchmark/staleness.py` (see its docstring); mean ± std over seeds.",
        "",
    ]
    if prep:
        init = prep["initial_policy"]
        lines += [
            f"Initial SFT policy: gold {init['gold_reward']:.3f}, greedy {init['greedy_accuracy']:.3f} "
            f"({prep['policy_parameters']:,} parameters, difficulty {prep['difficulty']}).",
            "",
        ]
    lines += [
        "| algorithm | setting | final gold | gold at matched KL | matched KL | final KL | final greedy | "
        "seeds | episodes | s/run |",
        "|" + "---|" * 10,
    ]
    for algo in ALGORITHMS:
        found = [s for s in settings_of(algo) + ["sync-2", "sync-8"] if runs.get((algo, s))]
        if not found:
            continue
        matched = min(max(p["kl"] for p in r["curve"]) for s in found for r in runs[(algo, s)])
        for setting in found:
            rs = runs[(algo, setting)]
            gold_matched = mean_std([gold_at_kl(r["curve"], matched) for r in rs])
            lines.append(
                f"| {algo} | {setting} | {fmt(mean_std([r['gold_reward'] for r in rs]))} | "
                f"{fmt(gold_matched)} | {matched:.3f} | {fmt(mean_std([r['kl'] for r in rs]))} | "
                f"{fmt(mean_std([r['greedy_accuracy'] for r in rs]))} | {len(rs)} | {rs[0]['episodes']} | "
                f"{mean_std([r['run_seconds'] + r['eval_seconds'] for r in rs])[0]:.0f} |"
            )
    lines += cost_tables(runs, prep) + off_policy_table(runs)
    if rate_sweep:
        lines += [
            "",
            "Learning-rate sweep on sync-1, one seed per rate (the lowest seed run at every rate, the one the "
            "rates were chosen on; the chosen rate's seed means are in the first table). Gold at each "
            "evaluation, from update 0; the rate each algorithm uses is marked *:",
            "",
            "| algorithm | learning rate | gold along the run | final KL | seed |",
            "|---|---|---|---|---|",
        ]
        for (algo, lr), rs in sorted(rate_sweep.items()):
            run = min(rs, key=lambda r: r["seed"])
            mark = " *" if lr == ALGORITHMS[algo]["learning_rate"] else ""
            golds = " ".join(f"{p['gold_reward']:.3f}" for p in run["curve"])
            lines.append(f"| {algo} | {lr:g}{mark} | {golds} | {run['curve'][-1]['kl']:.3f} | {run['seed']} |")
    (results_dir / "staleness.md").write_text("\n".join(lines) + "\n")
    if runs:
        plot(runs, prep, results_dir)
    return lines


# the settings whose cost ranks the algorithms: the most off-policy of each kind, async under the paper's own loss
RANKED = ("sync-16", "sync-32", "async-4", "async-8")
# a setting's cost is measured on the mean gold of the last evaluations, not on the final one alone: one evaluation's
# sampling noise (~0.02) is as large as the costs themselves
LATE_EVALUATIONS = 3


def late_gold(run):
    return sum(p["gold_reward"] for p in run["curve"][-LATE_EVALUATIONS:]) / len(run["curve"][-LATE_EVALUATIONS:])


def final_gold(run):
    return run["gold_reward"]


def cost_tables(runs, prep):
    """What staleness costs each algorithm (late gold minus its sync-1's, seed means), the ranking by the mean cost
    over RANKED (the paper's finding: online DPO loses less than PPO and RLOO), and the corrections side by side at
    the largest K."""
    fmt = lambda ms: f"{ms[0]:+.3f} ± {ms[1]:.3f}" if not math.isnan(ms[1]) else f"{ms[0]:+.3f}"

    def cost(algo, setting, gold=late_gold):
        """Gold minus sync-1's: the mean over seeds, and the std of the per-seed differences (seed s of a setting
        against seed s of sync-1, which shares its SFT policy and data order)."""
        base = {r["seed"]: gold(r) for r in runs.get((algo, "sync-1"), [])}
        diffs = [gold(r) - base[r["seed"]] for r in runs.get((algo, setting), []) if r["seed"] in base]
        return mean_std(diffs) if diffs else None

    def named(algo, setting):  # async-K means async-K-paper for the algorithms that have corrections
        kind, k, _ = parse_setting(setting)
        return f"{setting}-paper" if kind == "async" and ALGORITHMS[algo]["corrections"] else setting

    algos = [a for a in ALGORITHMS if runs.get((a, "sync-1"))]
    if not algos:
        return []
    columns = [f"sync-{n}" for n in SYNC_N[1:]] + [f"async-{k}" for k in ASYNC_K]
    late = [p["updates"] for p in runs[(algos[0], "sync-1")][0]["curve"][-LATE_EVALUATIONS:]]
    noise = ""
    if prep:  # sampling noise alone: the binomial standard error of a difference of two golds
        n = prep["flags"]["num_eval_problems"] * prep["flags"]["eval_samples"]
        gold = mean_std([r["gold_reward"] for a in algos for r in runs[(a, "sync-1")]])[0]
        se = math.sqrt(2 * gold * (1 - gold) / n)
        noise = (
            f" One evaluation is the accuracy of {n:,} samples, so two runs' golds differ by about {se:.3f} from "
            f"sampling alone (one standard error); a mean of {len(late)} evaluations lowers that, to "
            f"{se / math.sqrt(len(late)):.3f} if their draws were independent (they share random numbers, so "
            "the seeds' spread is the real measure)."
        )
    lines = [
        "",
        f"What staleness costs: late gold (the mean gold of the evaluations at updates "
        f"{', '.join(map(str, late))}) minus sync-1's, per seed, then mean ± std over seeds (async-K under the "
        "paper's loss, `--off-policy-correction paper`, for the algorithms that have a ratio)."
        + noise
        + f" Order: by the mean cost over {', '.join(RANKED)}, smallest cost first, an order of means, not a tested "
        "ranking (± the std over seeds of each "
        "seed's own mean cost); the same mean on the final gold alone is shown beside it.",
        "",
        "| algorithm | sync-1 late gold | " + " | ".join(columns) + " | mean cost | on final gold | rank |",
        "|" + "---|" * (len(columns) + 5),
    ]

    def seed_spread(algo):
        """The std over seeds of each seed's own mean cost over RANKED (seeds that have every RANKED setting): how far
        the ranking's number moves from one seed to the next."""
        per_seed = {}
        for setting in ("sync-1",) + RANKED:
            for r in runs.get((algo, named(algo, setting)), []):
                per_seed.setdefault(r["seed"], {})[setting] = late_gold(r)
        means = [sum(g[s] - g["sync-1"] for s in RANKED) / len(RANKED) for g in per_seed.values() if len(g) == 5]
        return mean_std(means)[1] if means else float("nan")

    mean_cost = {}
    for algo in algos:
        costs = {s: cost(algo, named(algo, s)) for s in columns}
        if all(costs[s] for s in RANKED):
            mean_cost[algo] = [
                sum(cost(algo, named(algo, s), gold)[0] for s in RANKED) / len(RANKED)
                for gold in (late_gold, final_gold)
            ] + [seed_spread(algo)]
    order = sorted(mean_cost, key=lambda a: mean_cost[a][0], reverse=True)
    for algo in algos:
        costs = {s: cost(algo, named(algo, s)) for s in columns}
        base = mean_std([late_gold(r) for r in runs[(algo, "sync-1")]])
        lines.append(
            f"| {algo} | {base[0]:.3f} | "
            + " | ".join(fmt(costs[s]) if costs[s] else "–" for s in columns)
            + (
                f" | {fmt((mean_cost[algo][0], mean_cost[algo][2]))} | {mean_cost[algo][1]:+.3f} | "
                f"{order.index(algo) + 1 if len(order) > 1 else '–'} |"
                if algo in mean_cost
                else " | – | – | (incomplete) |"
            )
        )
    corrected = [a for a in algos if ALGORITHMS[a]["corrections"]]
    if corrected:
        lines += [
            "",
            "Which correction recovers what staleness costs: late gold minus sync-1's at the largest lags, "
            "per `--off-policy-correction` (mean ± std over seeds).",
            "",
            "| algorithm | K | " + " | ".join(CORRECTIONS) + " |",
            "|" + "---|" * (len(CORRECTIONS) + 2),
        ]
        for algo in corrected:
            for k in ASYNC_K[-2:]:
                costs = [cost(algo, f"async-{k}-{c}") for c in CORRECTIONS]
                lines.append(f"| {algo} | {k} | " + " | ".join(fmt(c) if c else "–" for c in costs) + " |")
    return lines


def off_policy_table(runs):
    """How far off-policy each setting's data really were, from the runs' own metrics (mean over seeds; runs made
    before the benchmark recorded this are left out)."""
    lines = []
    for algo in ALGORITHMS:
        for setting in settings_of(algo):
            have = [r["off_policy"] for r in runs.get((algo, setting), []) if r.get("off_policy")]
            if not have:
                continue
            mean = lambda key, f: f.format(sum(h[key] for h in have) / len(have)) if have[0][key] is not None else "–"
            lines.append(
                f"| {algo} | {setting} | {mean('logprob_gap_mean', '{:.1e}')} | "
                f"{mean('logprob_gap_max', '{:.1e}')} | {mean('importance_ratio_max', '{:.3f}')} | "
                f"{mean('clipfrac_mean', '{:.4f}')} | {len(have)} |"
            )
    if not lines:
        return []
    return [
        "",
        "How far off-policy the data were, over each run: the mean and largest per-step gap |vLLM logprob - "
        "learner logprob| of the sampled tokens before the step's first update (`async/behaviour_learner_logprob_"
        "gap`: K policy versions of drift in async, ~1e-6 in sync), the largest importance ratio (sync-N's drift "
        "within a round shows here) and the mean clipped fraction.",
        "",
        "| algorithm | setting | gap, mean | gap, max | importance ratio, max | clipfrac | seeds |",
        "|---|---|---|---|---|---|---|",
    ] + lines


def plot(runs, prep, results_dir: Path):
    """One row per algorithm; columns: sync N, then async K under each correction (sync-1 dashed as the reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ALGORITHMS if any(key[0] == a for key in runs)]
    columns = ["sync"] + [f"async, {c}" for c in CORRECTIONS]
    for x_key, name, x_label in (
        ("kl", "staleness.png", "KL(pi || pi_sft)"),
        ("updates", "staleness_updates.png", "optimizer updates"),
    ):
        fig, axes = plt.subplots(len(algos), 4, figsize=(14, 3.0 * len(algos)), squeeze=False, sharey="row")
        for row, algo in zip(axes, algos):
            for col, (ax, column) in enumerate(zip(row, columns)):
                for setting in settings_of(algo) + ["sync-2", "sync-8"]:
                    kind, value, correction = parse_setting(setting)
                    in_column = (kind == "sync" and col == 0) or (
                        kind == "async"
                        and col > 0
                        and (correction == CORRECTIONS[col - 1] or (correction is None and col == 1))
                    )
                    reference = setting == "sync-1" and col > 0
                    if not runs.get((algo, setting)) or not (in_column or reference):
                        continue
                    curve = mean_curve(runs[(algo, setting)])
                    if reference:
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
                    ax.plot([p[x_key] for p in curve], [p["gold_reward"] for p in curve], markersize=3, **style)
                ax.set_title(
                    f"{algo}: {column}"
                    if col == 0 or ALGORITHMS[algo]["corrections"] or col == 1
                    else f"{algo}: (no correction modes)",
                    fontsize=9,
                )
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
            row[0].set_ylabel("gold (held-out accuracy)")
        for ax in axes[-1]:
            ax.set_xlabel(x_label)
        fig.tight_layout()
        fig.savefig(results_dir / name, dpi=110)
        plt.close(fig)


def quick_settings(args: Args):
    """--quick: tiny everything, so that the whole pipeline runs inside the test suite in minutes. Only fields left at
    their defaults shrink: a flag given explicitly next to --quick wins."""
    args.settings = [s for s in (args.settings or QUICK_SETTINGS) if s in QUICK_SETTINGS]
    args.seeds = args.seeds[:1]
    quick = dict(
        num_updates=4,
        eval_every_updates=2,
        num_train_problems=128,
        num_eval_problems=8,
        sft_max_steps=10,
        eval_samples=2,
        mini_batch_prompts=2,
        response_length=32,
    )
    defaults = Args()
    for name, value in quick.items():
        if getattr(args, name) == getattr(defaults, name):
            setattr(args, name, value)


def check(args: Args):
    """Bad flags fail in one line before anything is built."""
    unknown = [a for a in args.algorithms if a not in ALGORITHMS]
    if unknown:
        sys.exit(f"error: unknown --algorithms {unknown}; known: {list(ALGORITHMS)}")
    known = {s for a in ALGORITHMS for s in settings_of(a)} | set(QUICK_SETTINGS) | {"sync-2", "sync-8"}
    if args.settings is not None and [s for s in args.settings if s not in known]:
        sys.exit(f"error: unknown --settings {[s for s in args.settings if s not in known]}; known: {sorted(known)}")
    for s in args.settings or [s for a in args.algorithms for s in settings_of(a)]:
        n = setting_flags(s)[1]
        if args.eval_every_updates % n or args.num_updates % args.eval_every_updates:
            sys.exit(
                f"error: --eval-every-updates {args.eval_every_updates} must be a multiple of N of {s} and "
                f"divide --num-updates {args.num_updates}"
            )


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        quick_settings(args)
    check(args)
    results_dir = Path(args.results_dir)
    (results_dir / "runs").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        invocation_start, durations, new_runs = time.time(), [], 0
        prep = prepare(args, task)
        (results_dir / "runs" / "prep.json").write_text(json.dumps(prep, indent=1))
        if not args.prep_only:
            # seed-major order: a partial sweep has one complete seed of every setting before it starts the next seed
            for seed in args.seeds:
                for algo in args.algorithms:
                    for learning_rate in args.learning_rates or [ALGORITHMS[algo]["learning_rate"]]:
                        for setting in args.settings or settings_of(algo):
                            if parse_setting(setting)[2] and not ALGORITHMS[algo]["corrections"]:
                                continue  # DPO has no --off-policy-correction
                            path = result_path(args, algo, setting, learning_rate, seed)
                            if path.exists() and not args.force:
                                common.check_same_budget(path, budget(args, setting))
                                print(f"== {path.stem}: done already ({path})")
                                continue
                            if args.max_runs is not None and new_runs >= args.max_runs:
                                continue
                            expected = max(durations) if durations else 0.0
                            if (
                                args.time_budget_hours is not None
                                and time.time() - invocation_start + expected > 3600 * args.time_budget_hours
                            ):
                                print(f"== time budget reached: not starting {path.stem}")
                                continue
                            claimed = common.claim(Path(args.work_dir), path.stem)
                            if claimed is None:
                                print(f"== {path.stem}: being run by another invocation, skipped", flush=True)
                                continue
                            try:
                                if path.exists() and not args.force:  # finished by another one meanwhile
                                    continue
                                durations.append(run_one(args, task, algo, setting, learning_rate, seed, path))
                                new_runs += 1
                            finally:
                                claimed.unlink(missing_ok=True)
    print("\n".join(report(results_dir)))
