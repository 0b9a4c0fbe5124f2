"""The miniature task every staleness sweep runs on (Noukhovitch et al., 2025, Sec. 3, at CPU scale): its data,
tokenizer and SFT policy, the sampler and the KL its evaluations use, and the paper's run budget for a setting.
benchmark/staleness_paper.py builds on it (`prepare` is the first half of its prep); benchmark/staleness_sweep.py and
benchmark/staleness_dpo.py read `budget`. The verifier-reward sweep this file once ran is in git's history
(docs/benchmarks.md, History). `args` below is staleness_paper.py's Args (PREP_FLAGS, budget's fields, work_dir).

  task     one-step GSM8K-format arithmetic word problems from tools/make_arithmetic.py (difficulty 1). Two-step
           problems (difficulty 2) were tried first: RL did not raise this tiny model's held-out accuracy there
  policy   a 0.4M-parameter Llama trained here by SFT and stopped early, at about 0.2 greedy held-out accuracy, so
           that RL has room to raise it
  budget   as in the paper's code (where a generation batch is num_mini_batches x the mini-batch), the mini-batch and
           the number of optimizer updates are the same for every setting: sync-N generates N mini-batches per round
           and runs 1/N as many rounds, so only off-policyness varies; async-K trains on batches made K versions ago
"""

import json
import os
import platform
import random
import sys
import time
from pathlib import Path

PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


# PREP: data, tokenizer, SFT policy. Built once; prep.json records what was measured.
def write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_data(args, task, data_dir: Path):
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


def evaluate_policy(policy, sft, tokenizer, task, eval_set, args, seed: int):
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


def train_sft(args, tokenizer, task, train, eval_set, out_dir: Path, log):
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


def prepare(args, task):
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


# SETTINGS: sync-N and async-K, as the sweeps name them, and the budget every run of a sweep shares
def parse_setting(setting: str):
    """'sync-4' -> ('sync', 4, None); 'async-2-decoupled' -> ('async', 2, 'decoupled'); 'async-2' -> ('async', 2,
    None)."""
    kind, value, *correction = setting.split("-")
    return kind, int(value), (correction[0] if correction else None)


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


def budget(args, setting: str):
    """The paper's protocol: N mini-batches of a fixed size per generation round, num_updates / N rounds; a checkpoint
    every eval_every_updates updates, or every round where a round holds more updates (issue 54's sync-128)."""
    n = setting_flags(setting)[1]
    return {
        "--prompts-per-step": n * args.mini_batch_prompts,
        "--num-learner-steps": args.num_updates // n,
        "--response-length": args.response_length,
        "--save-every": max(1, args.eval_every_updates // n),
    }
