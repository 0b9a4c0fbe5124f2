"""Staleness table: how much does off-policy data hurt each algorithm? The paper's Sec. 3 protocol at CPU scale.

    python benchmark/staleness.py --prep-only                         # build the miniature task once (~4 min, idle CPU)
    python benchmark/staleness.py --algorithms dpo --seeds 1 --max-runs 4   # run a chunk of the sweep
    python benchmark/staleness.py --time-budget-hours 2               # run until 2 h are used, then stop cleanly
    python benchmark/staleness.py --report-only                       # rebuild staleness.md / .png from result files
    python benchmark/staleness.py --quick --algorithms dpo --results-dir D --work-dir W   # the test suite's smoke run

Paper (Noukhov et al., 2025, Sec. 3): train with N mini-batches per generation round (N-1 of the N updates use data
from an older policy) and compare final gold reward against KL to the initial policy. As in the paper's code (where a
generation batch is num_mini_batches x the mini-batch), the mini-batch and the number of optimizer updates are the same
for every setting: sync-N generates N mini-batches per round and runs 1/N as many rounds, so only off-policyness varies,
not the number, size or learning-rate schedule of the updates. Here the pipeline is rebuilt in
miniature so that the 108 runs fit in about 70 minutes on 2 idle CPU cores (a SmolLM2-135M step would take minutes):
  task     GSM8K-format arithmetic word problems from tools/make_arithmetic.py; gold = its grader (the same
           final-number rule as the scripts' GSM8K verifier, checked in tests)
  policy   a 0.4M-parameter Llama trained here by SFT until it is competent but imperfect
  proxy RM a Llama classifier initialised from the SFT policy, trained on the SFT policy's own samples labelled by the
           verifier; DPO, RLOO and PPO optimise it, GRPO optimises the verifier itself
Every run is one subprocess of the real sync or async script, then an evaluation of its saved policy by the verifier.
Each run writes one result file; a rerun skips finished runs, so the sweep can be done in chunks.
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
sys.path.insert(0, str(REPO / "tools"))
import make_arithmetic as task  # noqa: E402  the problem generator and its gold grader
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"

# ONE table of every per-algorithm choice. The episode budget of an algorithm (mini_batch_prompts x samples x
# num_updates) is the same for all its N / K settings. {sft}, {rm}, {data} are filled in at run time. Learning rates
# suit a tiny model SFT-trained at 2e-3, not Pythia; only spot-checked on sync-1 seed 1 under an earlier budget of 48
# updates: DPO at 1e-4 over-optimised the proxy RM (gold 0.40 -> 0.36 at KL 1.3), at 3e-5 gold rose to 0.415;
# GRPO (verifier reward, no proxy to over-optimise) at 1e-4 rose to 0.47. RLOO and PPO take DPO's rate, untested.
ALGORITHMS = {
    "dpo": dict(async_script="async_dpo.py", sync_script="sync_baselines/sync_dpo.py", samples=2,
                flags=["--reward-model-path", "{rm}", "--dataset-name", "{data}/prompts.jsonl",
                       "--num-samples-per-prompt", "2", "--learning-rate", "3e-5", "--beta", "0.1"]),
    "rloo": dict(async_script="async_rloo.py", sync_script="sync_baselines/sync_rloo.py", samples=2,
                 flags=["--reward-model-path", "{rm}", "--dataset-name", "{data}/prompts.jsonl",
                        "--num-samples-per-prompt", "2", "--learning-rate", "3e-5", "--kl-coef", "0.05"]),
    "ppo": dict(async_script="async_ppo.py", sync_script="sync_baselines/sync_ppo.py", samples=1,
                flags=["--reward-model-path", "{rm}", "--dataset-name", "{data}/prompts.jsonl",
                       "--num-samples-per-prompt", "1", "--learning-rate", "3e-5", "--kl-coef", "0.05"]),
    "grpo_gsm8k": dict(async_script="async_grpo_gsm8k.py", sync_script="sync_baselines/sync_grpo_gsm8k.py", samples=4,
                       flags=["--dataset-path", "{data}", "--prompt-template", PROMPT_TEMPLATE,
                              "--num-eval-prompts", "0", "--num-samples-per-prompt", "4", "--learning-rate", "1e-4"]),
}
# flags every run gets (prompt/response sizes fit the generated problems; no sample tables: they cost time)
COMMON_FLAGS = ["--model-name-or-path", "{sft}", "--max-prompt-tokens", "96", "--temperature", "0.7",
                "--torch-threads", "1", "--sample-every", "1000000"]
# the paper's off-policyness knobs: sync with N mini-batches (N=1 is fully on-policy), async with K steps of lag
# (script, N mini-batches per generation round, flags)
SETTINGS = {**{f"sync-{n}": ("sync_script", n, ["--num-mini-batches", str(n)]) for n in (1, 2, 4, 8, 16, 32)},
            **{f"async-{k}": ("async_script", 1, ["--async-steps", str(k)]) for k in (1, 2, 4)}}
QUICK_SETTINGS = ["sync-1", "sync-2", "async-1"]


@dataclass
class Args:
    algorithms: List[str] = field(default_factory=lambda: list(ALGORITHMS))
    """algorithms to run"""
    settings: List[str] = field(default_factory=lambda: list(SETTINGS))
    """settings to run: sync-N (N mini-batches per round) and async-K (K steps of lag)"""
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the RL runs (the prep is seeded separately and shared)"""
    mini_batch_prompts: int = 16
    """prompts per optimizer update, the same for every setting (a generation round of sync-N holds N mini-batches)"""
    num_updates: int = 96
    """optimizer updates per run, the same for every setting; must be divisible by every N (32 for sync-32)"""
    response_length: int = 48
    """maximum new tokens per response (worked solutions are ~22 tokens + EOS at difficulty 1, 33 at 2)"""
    difficulty: int = 1
    """arithmetic difficulty: operations per problem (operands up to 10*difficulty-1)"""
    num_train_problems: int = 4096
    """generated training problems (SFT, RM samples and RL prompts)"""
    num_eval_problems: int = 256
    """held-out problems for every evaluation (disjoint from the training problems)"""
    sft_max_steps: int = 1500
    """SFT optimizer steps at most (batch 32)"""
    sft_target_accuracy: float = 0.5
    """SFT stops at the first check whose greedy held-out accuracy reaches this: competent but imperfect"""
    rm_prompts: int = 2048
    """training problems whose SFT samples (4 each, temperature 0.7) train the proxy reward model"""
    rm_epochs: int = 4
    """passes of the reward-model training over its samples"""
    rm_learning_rate: float = 3e-4
    """AdamW learning rate of the reward model, decayed linearly to 0"""
    eval_samples: int = 4
    """samples per held-out problem (temperature 0.7) for the gold reward and the KL"""
    prep_threads: int = 2
    """torch threads for the prep and the evaluations (the RL runs use --torch-threads 1 per role)"""
    results_dir: str = str(REPO / "benchmark" / "results")
    """where result files, staleness.md and staleness.png go"""
    work_dir: str = str(REPO / "benchmark" / "work" / "staleness")
    """scratch space (git-ignored): data, tokenizer, SFT policy, reward model, run folders"""
    max_runs: Optional[int] = None
    """stop after this many new runs (None: no limit)"""
    time_budget_hours: Optional[float] = None
    """do not start a run that would likely end after this many hours of this invocation (None: no limit)"""
    quick: bool = False
    """smoke mode for the test suite: tiny prep, 2 learner steps, 1 seed, settings sync-1, sync-2, async-1"""
    prep_only: bool = False
    """build (or load) the prep and stop"""
    report_only: bool = False
    """only rebuild staleness.md and staleness.png from existing result files"""
    force: bool = False
    """rerun runs whose result file exists"""


# PREP: data, tokenizer, SFT policy, proxy reward model. Built once; prep.json records what was measured.
def write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_data(args: Args, task, data_dir: Path):
    """Train / held-out problems (disjoint questions) as GSM8K-format JSONL, and the prompt file of DPO/RLOO/PPO."""
    train = task.make_arithmetic_problems(args.num_train_problems, args.difficulty, seed=0)
    seen = {p["question"] for p in train}
    test = [p for p in task.make_arithmetic_problems(4 * args.num_eval_problems, args.difficulty, seed=1)
            if p["question"] not in seen][: args.num_eval_problems]
    data_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(data_dir / "train.jsonl", train)
    write_jsonl(data_dir / "test.jsonl", test)
    write_jsonl(data_dir / "prompts.jsonl", [{"query": PROMPT_TEMPLATE.format(question=p["question"])} for p in train])
    return train, test


def train_tokenizer(problems):
    """Byte-level BPE trained on the generated corpus (as tests/conftest.py); pad == EOS like Pythia and SmolLM2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [PROMPT_TEMPLATE.format(question=p["question"]) + " " + p["answer"] for p in problems]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
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


def sample(model, prompts, n, temperature, max_new, eos_id, seed, chunk=128):
    """n responses per prompt (prompt-major), each ending at its first EOS; greedy if temperature == 0.

    A plain KV-cache loop rather than `generate`: no hidden top-k / top-p defaults, so samples come from exactly
    softmax(logits / T), the distribution whose logprobs the KL uses. Prompts are batched by length, so there is no
    padding (left padding would shift Llama's positions).
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = [None] * (len(prompts) * n)
    by_length = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].extend(i * n + j for j in range(n))
    with torch.no_grad():
        for rows in (r[s : s + chunk] for r in by_length.values() for s in range(0, len(r), chunk)):
            result = model(input_ids=torch.tensor([prompts[r // n] for r in rows]), use_cache=True)
            done = torch.zeros(len(rows), dtype=torch.bool)
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
                result = model(input_ids=nxt[:, None], past_key_values=result.past_key_values, use_cache=True)
            for r, seq in zip(rows, torch.stack(tokens, 1).tolist()):
                out[r] = seq[: seq.index(eos_id) + 1] if eos_id in seq else seq
    return out


def response_logprob_sums(model, prompts, responses, temperature, pad_id, chunk=64):
    """sum_t log softmax(logits / T)[y_t] over each response's tokens (the scripts' `token_logprobs`, summed)."""
    import torch

    sums = []
    with torch.no_grad():
        for s in range(0, len(prompts), chunk):
            rows = [p + r for p, r in zip(prompts[s : s + chunk], responses[s : s + chunk])]
            ids, mask = pad_right(rows, pad_id)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            resp = torch.zeros_like(lp)
            for i, (p, r) in enumerate(zip(prompts[s : s + chunk], responses[s : s + chunk])):
                resp[i, len(p) - 1 : len(p) - 1 + len(r)] = 1  # column t scores token t+1
            sums.extend((lp * resp).sum(1).tolist())
    return sums


def grade(task, tokenizer, responses, answers, n):
    return [task.grade(tokenizer.decode(r, skip_special_tokens=True), answers[i // n])
            for i, r in enumerate(responses)]


def evaluate_policy(policy, sft, tokenizer, task, eval_set, args: Args, seed: int):
    """Gold reward (verifier accuracy) of T=0.7 samples and of greedy answers, and KL(pi || pi_sft) on pi's samples."""
    prompts, answers = eval_set
    n, eos = args.eval_samples, tokenizer.eos_token_id
    samples = sample(policy, prompts, n, 0.7, args.response_length, eos, seed)
    greedy = sample(policy, prompts, 1, 0.0, args.response_length, eos, seed)
    repeated = [p for p in prompts for _ in range(n)]
    # KL estimated on the policy's own samples, at the sampling temperature: E_y~pi [log pi(y) - log pi_sft(y)]
    kls = [a - b for a, b in zip(response_logprob_sums(policy, repeated, samples, 0.7, eos),
                                 response_logprob_sums(sft, repeated, samples, 0.7, eos))]
    gold = grade(task, tokenizer, samples, answers, n)
    return dict(gold_reward=sum(gold) / len(gold),
                greedy_accuracy=sum(grade(task, tokenizer, greedy, answers, 1)) / len(greedy),
                kl=sum(kls) / len(kls), eos_rate=sum(eos in s for s in samples) / len(samples),
                response_length=sum(map(len, samples)) / len(samples))


def train_sft(args: Args, tokenizer, task, train, eval_set, out_dir: Path, log):
    """SFT of a small Llama on prompt + worked answer + EOS, stopped once greedy held-out accuracy reaches the
    target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention needs head_dim >= 32; tied embeddings keep the tiny model tiny
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    prompts, _ = encode(tokenizer, train)
    answers = tokenizer([" " + p["answer"] for p in train])["input_ids"]
    examples = [(p, a + [tokenizer.eos_token_id]) for p, a in zip(prompts, answers)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    check_every = 10 if args.quick else 100
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
    return model, dict(sft_steps=step, sft_greedy_accuracy=accuracy, sft_history=history,
                       policy_parameters=sum(p.numel() for p in model.parameters()))


def rm_scores(rm, prompts, responses, pad_id):
    """Score at each sequence's last real token, as the scripts' `get_scores` (pad == EOS breaks HF's pooling)."""
    import torch

    ids, mask = pad_right([p + r for p, r in zip(prompts, responses)], pad_id)
    hidden = getattr(rm, rm.base_model_prefix)(input_ids=ids, attention_mask=mask).last_hidden_state
    return rm.score(hidden[torch.arange(len(ids)), mask.sum(1) - 1]).squeeze(-1).float()


def train_rm(args: Args, tokenizer, task, sft, train, eval_set, sft_dir: Path, out_dir: Path, log):
    """Proxy RM: the SFT weights plus a scalar head, trained with binary cross-entropy to predict the verifier's verdict
    on the SFT policy's own T=0.7 samples. Held-out accuracy is measured on samples of held-out problems."""
    import torch
    from transformers import LlamaForSequenceClassification

    n, eos = 4, tokenizer.eos_token_id
    prompts, answers = encode(tokenizer, train[: args.rm_prompts])
    responses = sample(sft, prompts, n, 0.7, args.response_length, eos, seed=1)
    labels = grade(task, tokenizer, responses, answers, n)
    data = [(prompts[i // n], r, y) for i, (r, y) in enumerate(zip(responses, labels))]
    eval_responses = sample(sft, eval_set[0], n, 0.7, args.response_length, eos, seed=2)
    eval_labels = grade(task, tokenizer, eval_responses, eval_set[1], n)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification.from_pretrained(sft_dir, num_labels=1)
    optimizer = torch.optim.AdamW(rm.parameters(), lr=args.rm_learning_rate)
    rng, batch_size = random.Random(0), 32
    num_updates = args.rm_epochs * math.ceil(len(data) / batch_size)
    update = 0
    for epoch in range(args.rm_epochs):
        rng.shuffle(data)
        for s in range(0, len(data), batch_size):
            batch = data[s : s + batch_size]
            for g in optimizer.param_groups:
                g["lr"] = args.rm_learning_rate * (1 - update / num_updates)
            scores = rm_scores(rm, [b[0] for b in batch], [b[1] for b in batch], tokenizer.pad_token_id)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, torch.tensor([b[2] for b in batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            update += 1
        log(f"RM epoch {epoch + 1}: last loss {loss.item():.3f}")
    rm.eval()
    with torch.no_grad():
        repeated = [p for p in eval_set[0] for _ in range(n)]
        scores = torch.cat([rm_scores(rm, repeated[s : s + 64], eval_responses[s : s + 64], tokenizer.pad_token_id)
                            for s in range(0, len(repeated), 64)])
    correct = [(s > 0) == bool(y) for s, y in zip(scores.tolist(), eval_labels)]
    rm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return dict(rm_train_samples=len(data), rm_train_positive_rate=sum(d[2] for d in data) / len(data),
                rm_heldout_accuracy=sum(correct) / len(correct),
                rm_heldout_majority_baseline=max(sum(eval_labels), len(eval_labels) - sum(eval_labels))
                / len(eval_labels),
                rm_parameters=sum(p.numel() for p in rm.parameters()))


PREP_FLAGS = ("difficulty", "num_train_problems", "num_eval_problems", "sft_max_steps", "sft_target_accuracy",
              "rm_prompts", "rm_epochs", "rm_learning_rate", "eval_samples")


def prepare(args: Args, task):
    """Build data, tokenizer, SFT policy and reward model once; returns the prep numbers (from prep.json if built)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    prep_file = work / "prep.json"
    wanted = {name: getattr(args, name) for name in PREP_FLAGS}
    if prep_file.exists():
        prep = json.loads(prep_file.read_text())
        # the cache is keyed by folder: a prep built with other flags must not be reused silently
        if prep.get("flags") != wanted:
            sys.exit(f"error: the prep in {work} was built with {prep.get('flags')}, "
                     f"this invocation asks for {wanted}; "
                     "pass another --work-dir (and --results-dir) or delete that folder")
        return prep
    torch.set_num_threads(args.prep_threads)
    log = lambda msg: print(f"[prep {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    start = time.time()
    train, test = make_data(args, task, work / "data")
    tokenizer = train_tokenizer(train)
    eval_set = encode(tokenizer, test)
    log(f"{len(train)} train / {len(test)} held-out problems, vocabulary {len(tokenizer)}, "
        f"prompt ~{sum(map(len, eval_set[0])) / len(test):.0f} tokens")
    sft, sft_stats = train_sft(args, tokenizer, task, train, eval_set, work / "sft", log)
    sft_time = time.time() - start
    rm_stats = train_rm(args, tokenizer, task, sft, train, eval_set, work / "sft", work / "rm", log)
    rm_time = time.time() - start - sft_time
    # the starting point of every run, measured exactly as the runs are (KL to itself is 0 by definition)
    sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    initial = evaluate_policy(sft, sft, AutoTokenizer.from_pretrained(work / "sft"), task, eval_set, args, seed=0)
    prep = dict(flags=wanted, difficulty=args.difficulty, num_train_problems=len(train), num_eval_problems=len(test),
                vocab_size=len(tokenizer), **sft_stats, **rm_stats, initial_policy=initial,
                sft_seconds=round(sft_time), rm_seconds=round(rm_time), total_seconds=round(time.time() - start),
                threads=args.prep_threads, machine=f"{platform.machine()}, {os.cpu_count()} cores (shared)")
    prep_file.write_text(json.dumps(prep, indent=1))
    log(json.dumps({k: v for k, v in prep.items() if k != "sft_history"}))
    return prep


# SWEEP: one subprocess per (algorithm, setting, seed), then the evaluation of its saved policy
def run_one(args: Args, task, algo: str, setting: str, seed: int, result_path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    spec = ALGORITHMS[algo]
    script_key, _, setting_flags = SETTINGS[setting]
    # str.replace, not str.format: GRPO's --prompt-template holds a literal {question}
    fill = {"{sft}": work / "sft", "{rm}": work / "rm", "{data}": work / "data"}
    flags = COMMON_FLAGS + spec["flags"]
    for key, value in fill.items():
        flags = [f.replace(key, str(value)) for f in flags]
    cwd = work / "runs" / result_path.stem
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / spec[script_key]), *flags, *setting_flags, "--seed", str(seed),
           *[str(x) for item in budget(args, setting).items() for x in item], "--output-dir", str(cwd / "model")]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    print(f"== {algo} {setting} seed {seed}: {' '.join(cmd)}", flush=True)
    start = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {algo} {setting} seed {seed} failed:\n{proc.stderr[-5000:]}")
    run_seconds = time.time() - start
    (metrics_path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    torch.set_num_threads(args.prep_threads)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    policy = AutoModelForCausalLM.from_pretrained(cwd / "model").eval()
    sft = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    test = [json.loads(line) for line in (work / "data" / "test.jsonl").read_text().splitlines()]
    # evaluation seed differs per run seed but not per setting: settings are compared on the same random numbers
    evaluation = evaluate_policy(policy, sft, tokenizer, task, encode(tokenizer, test), args, seed=1000 + seed)
    result = dict(algorithm=algo, setting=setting, seed=seed, command=cmd[1:], **evaluation,
                  episodes=metrics[-1]["episodes"], run_seconds=round(run_seconds, 1),
                  eval_seconds=round(time.time() - start - run_seconds, 1), date=time.strftime("%Y-%m-%d %H:%M"),
                  machine=f"{platform.machine()}, {os.cpu_count()} cores", final_metrics=metrics[-1])
    result_path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)  # the run folder and saved policy are not needed any more
    print(f"   gold {evaluation['gold_reward']:.3f}  greedy {evaluation['greedy_accuracy']:.3f}  "
          f"KL {evaluation['kl']:.3f}  ({run_seconds:.0f}s run + {result['eval_seconds']:.0f}s eval)", flush=True)
    return time.time() - start


def budget(args: Args, setting: str):
    """The paper's protocol: N mini-batches of a fixed size per generation round, num_updates / N rounds."""
    n = SETTINGS[setting][1]
    return {"--prompts-per-step": n * args.mini_batch_prompts, "--num-learner-steps": args.num_updates // n,
            "--response-length": args.response_length}


def check_same_budget(path: Path, args: Args, setting: str):
    """A finished run is only reused if it had this invocation's budget; a silent mix would corrupt the table."""
    command = json.loads(path.read_text())["command"]
    wanted = budget(args, setting)
    found = {flag: int(command[command.index(flag) + 1]) for flag in wanted}
    if found != wanted:
        sys.exit(f"error: {path} was made with {found}, this invocation asks for {wanted}; "
                 "pass --force to rerun it or --results-dir to keep both sweeps")


# REPORT: rebuilt from the result files alone
def mean_std(values):
    m = sum(values) / len(values)
    return m, (math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan"))


def report(results_dir: Path):
    """Rebuild staleness.md and staleness.png from results_dir/staleness/*.json."""
    runs = defaultdict(list)
    for path in sorted((results_dir / "staleness").glob("*__*__seed*.json")):
        r = json.loads(path.read_text())
        runs[(r["algorithm"], r["setting"])].append(r)
    prep_path = results_dir / "staleness" / "prep.json"
    prep = json.loads(prep_path.read_text()) if prep_path.exists() else None
    lines = ["Staleness (Noukhov et al. 2025, Sec. 3) in miniature: gold reward = verifier accuracy of temperature-0.7",
             "samples on held-out problems; KL = mean over the policy's own samples of sum_t log pi - log pi_sft "
             "(T=0.7).",
             "sync-N: N mini-batches per generation round; async-K: batches generated K policy versions ago.",
             "Produced by `python benchmark/staleness.py` (see its docstring); mean ± std over seeds.", ""]
    if prep:
        init = prep["initial_policy"]
        lines += [f"Initial SFT policy: gold {init['gold_reward']:.3f}, greedy {init['greedy_accuracy']:.3f}; proxy RM "
                  f"held-out accuracy {prep['rm_heldout_accuracy']:.3f} "
                  f"(majority {prep['rm_heldout_majority_baseline']:.3f}).", ""]
    lines += ["| algorithm | setting | gold reward | greedy accuracy | KL to SFT | seeds | episodes | s/run |",
              "|" + "---|" * 8]
    fmt = lambda ms: f"{ms[0]:.3f} ± {ms[1]:.3f}" if not math.isnan(ms[1]) else f"{ms[0]:.3f}"
    points = defaultdict(list)
    for algo in ALGORITHMS:
        for setting in SETTINGS:
            rs = runs.get((algo, setting))
            if not rs:
                continue
            if len({r["episodes"] for r in rs}) > 1:
                sys.exit(f"error: {algo} {setting} has result files with different episode budgets "
                         f"{sorted({r['episodes'] for r in rs})} in {results_dir / 'staleness'}")
            gold, kl = mean_std([r["gold_reward"] for r in rs]), mean_std([r["kl"] for r in rs])
            lines.append(f"| {algo} | {setting} | {fmt(gold)} | {fmt(mean_std([r['greedy_accuracy'] for r in rs]))} | "
                         f"{fmt(kl)} | {len(rs)} | {rs[0]['episodes']} | "
                         f"{mean_std([r['run_seconds'] + r['eval_seconds'] for r in rs])[0]:.0f} |")
            points[algo].append((setting, gold, kl))
    (results_dir / "staleness.md").write_text("\n".join(lines) + "\n")
    if points:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        algos = list(points)
        fig, axes = plt.subplots(1, len(algos), figsize=(3.6 * len(algos), 3.4), squeeze=False)
        sync_colors = plt.get_cmap("viridis")
        for ax, algo in zip(axes[0], algos):
            if prep:
                ax.plot(0, prep["initial_policy"]["gold_reward"], "k*", markersize=10, label="SFT")
            for setting, gold, kl in points[algo]:
                kind, value = setting.split("-")
                # sync N on a colour ramp (log2 N / 5), async K as red-ish triangles darkening with K
                if kind == "sync":
                    color = sync_colors(math.log2(int(value)) / 5)
                else:
                    color = plt.get_cmap("Reds")(0.4 + 0.15 * int(value) / 1.5)
                ax.errorbar(kl[0], gold[0], xerr=0 if math.isnan(kl[1]) else kl[1],
                            yerr=0 if math.isnan(gold[1]) else gold[1], fmt="o" if kind == "sync" else "^",
                            color=color, label=f"{'N' if kind == 'sync' else 'K'}={value}")
            ax.set_title(algo)
            ax.set_xlabel("KL(pi || pi_sft)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("gold reward (verifier accuracy)")
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        fig.savefig(results_dir / "staleness.png", dpi=120)
        plt.close(fig)
    return lines


def quick_settings(args: Args):
    """--quick: tiny everything, so that the whole pipeline runs inside the test suite in minutes. Only fields left at
    their defaults shrink: a flag given explicitly next to --quick wins."""
    explicit = args.settings != list(SETTINGS)
    args.settings = [s for s in args.settings if s in QUICK_SETTINGS] if explicit else QUICK_SETTINGS
    args.seeds = args.seeds[:1]
    quick = dict(num_updates=2, num_train_problems=128, num_eval_problems=8, sft_max_steps=10, rm_prompts=16,
                 rm_epochs=1, eval_samples=2, mini_batch_prompts=2, response_length=32)
    defaults = Args()
    for name, value in quick.items():
        if getattr(args, name) == getattr(defaults, name):
            setattr(args, name, value)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        quick_settings(args)
    for name, chosen, known in (("--algorithms", args.algorithms, ALGORITHMS), ("--settings", args.settings, SETTINGS)):
        if [a for a in chosen if a not in known]:
            sys.exit(f"error: unknown {name} {[a for a in chosen if a not in known]}; known: {list(known)}")
    if [s for s in args.settings if args.num_updates % SETTINGS[s][1]]:
        sys.exit(f"error: --num-updates {args.num_updates} must be divisible by N of every sync-N setting "
                 f"{[SETTINGS[s][1] for s in args.settings]}")
    results_dir = Path(args.results_dir)
    (results_dir / "staleness").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        invocation_start, durations, new_runs = time.time(), [], 0
        prep = prepare(args, task)
        (results_dir / "staleness" / "prep.json").write_text(json.dumps(prep, indent=1))
        if not args.prep_only:
            # seed-major order: a partial sweep has one complete seed of every setting before it starts the next seed
            for seed in args.seeds:
                for algo in args.algorithms:
                    for setting in args.settings:
                        path = results_dir / "staleness" / f"{algo}__{setting}__seed{seed}.json"
                        if path.exists() and not args.force:
                            check_same_budget(path, args, setting)
                            print(f"== {algo} {setting} seed {seed}: done already ({path})")
                            continue
                        if args.max_runs is not None and new_runs >= args.max_runs:
                            continue
                        expected = max(durations) if durations else 0.0
                        if args.time_budget_hours is not None and \
                                time.time() - invocation_start + expected > 3600 * args.time_budget_hours:
                            print(f"== time budget reached: not starting {algo} {setting} seed {seed}")
                            continue
                        durations.append(run_one(args, task, algo, setting, seed, path))
                        new_runs += 1
    print("\n".join(report(results_dir)))
