"""The learner's time per step against the minimal work of each algorithm, and what each extra costs (issue 31).

    python benchmark/learner_cost.py        # the four algorithms at the speed table's settings; ~1 h on 2 idle cores
    python benchmark/learner_cost.py --algorithms grpo_gsm8k --revisions worktree b7cbda8   # before -> after
    python benchmark/learner_cost.py --algorithms ppo --micro-batch-memory-gib 8   # PPO's 8 sequences in one pass
    python benchmark/learner_cost.py --quick --policy P --reward-model R --prompts F --dataset-path D --results-dir D

Per algorithm, at the speed table's setting (benchmark/speed.py: its flags, 8 sequences of at most 48 new tokens per
step) with one torch thread:
  minimal work  what a learner step cannot do without: one forward+backward of the policy over the whole batch in one
                micro-batch and the update (gradient clip, AdamW); PPO's value model in the same pass; the reference's
                no-grad forward where the loss has a KL term (DPO, RLOO, PPO; GRPO's default --kl-coef 0 has none).
                The reward model is not counted: it scores in the generation thread, beside the engine.
  learner step  the real sync twin (per --revisions: the checkout's, or a git revision's) run for warm-up + measured
                steps: its `time/training` (the loop body), plus what the learner does per version outside it: the
                guard's probe, the weight copy the async core hands the engine, and logging (the run's step time
                outside its logged phases). The sync twin runs the loop body of the async core without the overlap.
  extras        each timed alone, as the difference it makes: the anchor pass (pi_old by a no-grad forward), PPO's
                value rollout pass and entropy, a micro-batch split, autocast, the guard (learner and engine side),
                the weight copy, logging.
The in-process rows use the core's own functions on the batches of the run's measured steps, made again by the
core's produce_batch from policy version 0 (the run trained at learning rate 1e-6 in between, so the report compares
the mean response lengths), so the run and the rows time the same tensors. Every row is timed --repeats times,
interleaved, after a warm-up round; the tables give median, min and max.
Writes results/learner_cost/learner_cost.{json,md}.
"""

import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import tyro

import common
import speed  # the speed table's settings and inputs

REPO = common.REPO

PHASES = ("time/weight_sync", "time/generation", "time/reward_labeling", "time/training")  # logged; the rest: logging
NEEDS_REFERENCE = {"dpo": True, "rloo": True, "ppo": True}  # GRPO: only with --kl-coef > 0


@dataclass
class Args:
    algorithms: List[str] = field(default_factory=lambda: list(speed.TABLE))
    """algorithms to measure, each at its speed-table setting"""
    revisions: List[str] = field(default_factory=lambda: ["worktree"])
    """whose sync twin the learner-step row runs: worktree (this checkout) or a git revision, e.g. b7cbda8"""
    repeats: int = 3
    """runs of each script and timings of each in-process row (after one untimed warm-up round)"""
    warmup_steps: int = 2
    """learner steps of each run left out (at least 1: a step's logging is read from the previous step's end). Two:
    AdamW makes its state at the end of step 0, so step 1 is the first to reach the run's peak memory, and memory
    touched for the first time is slow on this machine (a VM; after 1 warm-up step the first measured step ran 4-25 s
    above the next two in every run of DPO, RLOO and PPO, more than its wider batch explains), a one-off the
    in-process rows' warm-up round pays too"""
    measured_steps: int = 3
    """learner steps timed per run; the in-process rows use the same steps' batches"""
    policy: Optional[str] = None
    """policy model folder; None: models/SmolLM2-135M-Instruct (made by install.sh)"""
    reward_model: Optional[str] = None
    """reward model folder; None: the speed table's random-head SmolLM2 classifier (made once under --work-dir)"""
    prompts: Optional[str] = None
    """prompt JSONL with a `query` field; None: the speed table's (made once under --work-dir)"""
    dataset_path: Optional[str] = None
    """GRPO's problem folder (train.jsonl, test.jsonl); None: data/arithmetic, as the speed table"""
    results_dir: str = str(REPO / "benchmark" / "results" / "learner_cost")
    """where learner_cost.json and learner_cost.md go"""
    work_dir: str = str(REPO / "benchmark" / "work")
    """scratch space (git-ignored): run folders, old revisions' scripts, the speed table's inputs"""
    micro_batch_memory_gib: Optional[float] = None
    """the scripts' --micro-batch-memory-gib, for every run and row (None: their default, 4 GiB)"""
    quick: bool = False
    """smoke mode for the test suite: 1 repeat, 1 measured step, responses of at most 16 tokens"""


def with_flag(flags: List[str], name: str, value) -> List[str]:
    i = flags.index(name)
    return flags[: i + 1] + [str(value)] + flags[i + 2 :]


def script_flags(args: Args, algo: str) -> List[str]:
    """The speed table's flags of `algo`, its inputs filled in, and the steps of this benchmark's runs."""
    flags = [
        f.format(policy=args.policy, reward_model=args.reward_model, prompts=args.prompts)
        for f in speed.SETTINGS[algo]["flags"]
    ]
    if args.dataset_path and "--dataset-path" in flags:
        flags = with_flag(flags, "--dataset-path", args.dataset_path)
    if args.quick:
        flags = with_flag(with_flag(flags, "--response-length", 16), "--max-prompt-tokens", 64)
    if args.micro_batch_memory_gib is not None:
        flags = flags + ["--micro-batch-memory-gib", str(args.micro_batch_memory_gib)]
    return flags + [
        "--torch-threads",
        "1",
        "--seed",
        "1",
        "--sample-every",
        "1000",
        "--num-learner-steps",
        str(args.warmup_steps + args.measured_steps),
    ]


def sync_script(args: Args, algo: str, revision: str) -> Path:
    """The sync twin of `algo` as it is in the checkout, or as it was at `revision` (written under --work-dir)."""
    if revision == "worktree":
        return REPO / "sync_baselines" / f"sync_{algo}.py"
    path = Path(args.work_dir) / "revisions" / revision / f"sync_{algo}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        subprocess.run(
            ["git", "-C", str(REPO), "show", f"{revision}:sync_baselines/sync_{algo}.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    return path


def run_script(args: Args, algo: str, revision: str, repeat: int):
    """One run of the sync twin; per measured step its `time/training`, its logging (the step's wall time outside the
    logged phases: metrics, tensorboard, metrics.jsonl, progress bar) and its mean response length."""
    cwd = Path(args.work_dir) / f"learner_cost__{algo}__{revision}"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [
        sys.executable,
        str(sync_script(args, algo, revision)),
        *script_flags(args, algo),
        "--output-dir",
        str(cwd / "model"),
    ]
    print(f"== {algo} {revision} run {repeat}: {' '.join(cmd)}", flush=True)
    proc = common.run_script(cmd, cwd, f"{algo} ({revision})", env=common.QUIET)
    (path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in path.read_text().splitlines()]
    shutil.rmtree(cwd, ignore_errors=True)  # the saved model is large and not needed
    timed = metrics[args.warmup_steps :]
    micro = re.search(r"^micro-batch .*$", proc.stdout, re.MULTILINE)  # the scripts that choose it print the choice
    return dict(
        command=cmd[1:],
        micro_batch=micro.group(0) if micro else None,
        training=[m["time/training"] for m in timed],
        logging=[
            m["time/elapsed"] - before["time/elapsed"] - sum(m.get(key, 0.0) for key in PHASES)
            for before, m in zip(metrics[args.warmup_steps - 1 :], timed)
        ],
        response_length=[m["val/response_length"] for m in timed],
    )


def measure_rows(args: Args):
    """Every in-process row of every algorithm, on the batches of the runs' measured steps."""
    import torch
    from transformers import AutoModelForSequenceClassification

    modules = {algo: common.load_script(f"async_{algo}.py") for algo in args.algorithms}
    runs = {}
    for algo, m in modules.items():
        run = tyro.cli(m.RunArgs, args=script_flags(args, algo))
        run.engine_device = run.learner_device = "cpu"
        run.kv_cache_gib, run.gpu_memory_utilization = run.kv_cache_gib or 1.0, run.gpu_memory_utilization or 0.1
        runs[algo] = run
    first = modules[args.algorithms[0]]
    first.SET_TORCH_THREADS(1)
    llm = first.build_engine(runs[args.algorithms[0]])  # one engine: the four settings build it alike
    first.SET_TORCH_THREADS(1)
    reward_model = None  # one for the three algorithms that score with it
    results = {}
    for algo, m in modules.items():
        if algo != "grpo_gsm8k" and reward_model is None:
            reward_model = (
                AutoModelForSequenceClassification.from_pretrained(
                    runs[algo].reward_model_path, num_labels=1, dtype=torch.float32
                )
                .eval()
                .requires_grad_(False)
            )
        results[algo] = measure_algorithm(args, algo, m, runs[algo], llm, reward_model)
        gc.collect()  # this algorithm's models go before the next one's load
    return results


def measure_algorithm(args: Args, algo: str, m, run, llm, reward_model):
    """The in-process rows of one algorithm, each --repeats times, interleaved, on the measured steps' batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ppo = algo == "ppo"
    tokenizer, run.eos_token_ids = m.load_tokenizer(run)
    if algo == "grpo_gsm8k":
        prompts, answers, _ = m.build_prompts(m.load_problems(run, "train"), tokenizer, run)
    else:
        prompts, answers = m.load_prompts(run, tokenizer)
    n, k = run.prompts_per_step, run.num_samples_per_prompt
    order = m.prompt_order(len(prompts), run.num_learner_steps * n, run.seed)
    batch_of = lambda step: (
        [prompts[j] for j in order[step * n : (step + 1) * n]],
        [answers[j] for j in order[step * n : (step + 1) * n]],
    )
    probe = (batch_of(0)[0][0] * 32)[:32]  # as the scripts make theirs
    sequences = (2 * n if algo == "dpo" else n * k) // run.num_mini_batches  # per mini-batch
    if hasattr(m, "choose_micro_batch_size"):  # as the script resolves --micro-batch-size None
        run.micro_batch_size = m.choose_micro_batch_size(
            run, sequences, max(map(len, prompts)) + run.response_length, 1 + ppo
        )
    steps = range(args.warmup_steps, args.warmup_steps + args.measured_steps)
    produced = [
        m.produce_batch(llm, *([] if algo == "grpo_gsm8k" else [reward_model]), tokenizer, run, *batch_of(step), step)
        for step in steps
    ]

    policy = AutoModelForCausalLM.from_pretrained(run.model_name_or_path, dtype=torch.float32).eval()
    ref_policy = value_model = None
    if NEEDS_REFERENCE.get(algo, getattr(run, "kl_coef", 0) > 0):
        ref_policy = AutoModelForCausalLM.from_pretrained(run.model_name_or_path, dtype=torch.float32)
        ref_policy = ref_policy.eval().requires_grad_(False)
    if ppo:
        value_model = AutoModelForSequenceClassification.from_pretrained(
            run.reward_model_path, num_labels=1, dtype=torch.float32
        ).eval()
    m.keep_models_eager(policy, ref_policy, value_model)
    params = [*policy.parameters(), *(value_model.parameters() if ppo else [])]
    optimizer = torch.optim.AdamW(params, lr=run.learning_rate, eps=1e-5, weight_decay=run.weight_decay)
    check = m.weight_check(policy, probe, run)  # version 0, as the engine holds: the engine check passes

    # the batches as the loop lays them out, and what its loss takes from before the first update (pi_old, the
    # reference, PPO's values and advantages), computed once here: data for the minimal step, as they are at N = 1
    batches = []
    for b in produced:
        prompts_b = (
            b["prompts"] * 2
            if algo == "dpo"
            else [p for p in b["prompts"] for _ in range(k)]
            if algo == "grpo_gsm8k"
            else b["prompts"]
        )
        responses = b["chosen"] + b["rejected"] if algo == "dpo" else b["responses"]
        ids, am, rm = m.pad_sequences(prompts_b, responses, tokenizer.pad_token_id, "cpu")
        x = dict(ids=ids, am=am, rm=rm, mask=rm[:, 1:].float(), pairs=len(b["prompts"]))
        old = m.token_logprobs_no_grad(policy, ids, am, rm, run)
        ref = None if ref_policy is None else m.token_logprobs_no_grad(ref_policy, ids, am, rm, run)
        if algo == "dpo":
            x["ref"] = ref.sum(1)
        else:
            behaviour = m.behaviour_logprobs_tensor(b["behaviour_logprobs"], rm)
            x["anchor"], x["weights"] = m.off_policy_anchor(
                run.off_policy_correction, old, behaviour, run.importance_weight_cap
            )
            x["ref"] = ref
        if algo == "rloo":
            kl = x["anchor"].sum(1) - ref.sum(1)
            x["advantages"] = m.rloo_advantages(b["scores"] - run.kl_coef * kl, k)
        elif algo == "grpo_gsm8k":
            x["advantages"] = m.group_advantages(b["rewards"], k, run.scale_rewards)
        elif ppo:
            with torch.no_grad():
                x["values"] = m.get_values(value_model, ids, am) * x["mask"]
            rewards, _ = m.per_token_rewards(b["scores"], x["anchor"], ref, x["mask"], run.kl_coef)
            advantages, x["returns"] = m.compute_gae(rewards, x["values"], x["mask"], run.gamma, run.lam)
            x["advantages"] = m.masked_whiten(advantages, x["mask"])
        batches.append(x)

    def step(x, micro: int, entropy: bool = False):
        """One update on the whole batch in micro-batches of `micro` sequences: the loop body at N = 1 without
        its extras (the anchor, the reference and PPO's values come from `x`), with the scripts' own losses."""
        optimizer.zero_grad()
        units = torch.arange(x["pairs"] if algo == "dpo" else len(x["ids"]))
        for unit in m.chunks(units, max(1, micro // 2) if algo == "dpo" else micro):
            rows = torch.cat([unit, unit + x["pairs"]]) if algo == "dpo" else unit
            ids, am, rm, mask = x["ids"][rows], x["am"][rows], x["rm"][rows], x["mask"][rows]
            if entropy:
                new, _ = m.token_logprobs_and_entropy(policy, ids, am, rm, run.temperature)
            else:
                new = m.token_logprobs(policy, ids, am, rm, run.temperature)
            share = len(unit) / len(units)
            if algo == "dpo":
                logratio = new.sum(1) - x["ref"][rows]
                loss = m.dpo_loss(logratio[: len(unit)], logratio[len(unit) :], run.beta)
            elif algo == "rloo":
                loss, _ = m.clipped_policy_loss(
                    new,
                    x["anchor"][rows],
                    x["weights"][rows],
                    x["advantages"][rows],
                    mask,
                    run.cliprange,
                    run.dual_clip,
                )
            elif algo == "grpo_gsm8k":
                loss, _ = m.grpo_policy_loss(
                    new,
                    x["anchor"][rows],
                    x["weights"][rows],
                    x["advantages"][rows],
                    mask,
                    run.cliprange,
                    run.dual_clip,
                    run.loss_aggregation,
                    run.response_length,
                )
                if ref_policy is not None:
                    kl = m.kl_penalty(new, x["ref"][rows], mask, run.loss_aggregation, run.response_length)
                    loss = loss + run.kl_coef * kl
            else:
                new_values = m.get_values(value_model, ids, am)
                pg_loss, _ = m.clipped_policy_loss(
                    new,
                    x["anchor"][rows],
                    x["weights"][rows],
                    x["advantages"][rows],
                    mask,
                    run.cliprange,
                    run.dual_clip,
                )
                vf_loss, _ = m.clipped_value_loss(
                    new_values, x["values"][rows], x["returns"][rows], mask, run.cliprange_value
                )
                loss, share = pg_loss + run.vf_coef * vf_loss, (mask.sum() / x["mask"].sum()).item()
            (loss * share).backward()
        torch.nn.utils.clip_grad_norm_(params, run.max_grad_norm)
        optimizer.step()

    @torch.no_grad()
    def rollout_values(x):  # as the loop computes V_old: in micro-batches, without gradient
        return torch.cat(
            [
                m.get_values(value_model, x["ids"][rows], x["am"][rows])
                for rows in m.chunks(torch.arange(len(x["ids"])), run.micro_batch_size)
            ]
        )

    def autocast_entries(x, times=1000):
        for _ in range(times):
            with m.learner_autocast(run):
                pass

    whole = len(batches[0]["ids"])
    pieces = {
        "policy_step": lambda x: step(x, whole),
        "reference": None
        if ref_policy is None
        else lambda x: m.token_logprobs_no_grad(ref_policy, x["ids"], x["am"], x["rm"], run),
        "anchor": None
        if algo == "dpo"
        # DPO's loss has no pi_old
        else lambda x: m.token_logprobs_no_grad(policy, x["ids"], x["am"], x["rm"], run),
        "values": None if not ppo else rollout_values,
        "step_with_entropy": None if not ppo else lambda x: step(x, whole, entropy=True),
        "step_micro_batched": None
        if run.micro_batch_size >= whole
        else lambda x: step(x, run.micro_batch_size, entropy=ppo),
        "autocast_entry": autocast_entries,  # 1000 entries: divided below
        "guard_probe": lambda x: m.weight_check(policy, probe, run),
        "guard_engine": lambda x: m.check_weight_sync(llm, check, None, run, 0),
        "weight_copy": lambda x: {name: t.detach().to("cpu", copy=True) for name, t in policy.state_dict().items()},
    }
    pieces = {name: fn for name, fn in pieces.items() if fn is not None}
    seconds = {name: [] for name in pieces}
    per_batch = {name: [] for name in ("policy_step", "reference") if name in pieces}  # [repeat][batch] seconds
    for repeat in range(args.repeats + 1):  # round 0 warms every piece up (allocations, AdamW's state)
        print(f"== {algo}: in-process round {repeat} of {args.repeats}", flush=True)
        for name, fn in pieces.items():
            times = []
            for x in batches:
                start = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - start)
            if repeat:
                seconds[name].append(sum(times) / len(batches) / (1000 if name == "autocast_entry" else 1))
                if name in per_batch:
                    per_batch[name].append(times)
    return dict(
        seconds=seconds,
        per_batch=per_batch,
        micro_batch_size=run.micro_batch_size,
        sequences=whole,
        padded_tokens=[x["ids"].numel() for x in batches],
        widths=[x["ids"].shape[1] for x in batches],
        response_length=[b["val/response_length"] for b in produced],
        torch_threads=torch.get_num_threads(),
        off_policy_correction=getattr(run, "off_policy_correction", None),
        kl_coef=getattr(run, "kl_coef", None),
    )


def spread(values):
    return [statistics.median(values), min(values), max(values)]


def summarize(algo: str, rows: dict, runs: dict):
    """The table's rows of one algorithm, each [median, min, max] seconds per step over the repeats; repeat r of a
    sum or a difference combines repeat r of its parts."""
    s = rows["seconds"]
    repeats = len(s["policy_step"])
    zero = [0.0] * repeats
    minimal = [a + b for a, b in zip(s["policy_step"], s.get("reference", zero))]
    entries = 1 + ("anchor" in s) + ("reference" in s) + ("values" in s)  # the loop's micro-batch, no-grad passes
    out = {
        "minimal": minimal,
        "policy_step": s["policy_step"],
        "reference": s.get("reference"),
        "anchor": s.get("anchor"),
        "values": s.get("values"),
        "entropy": [a - b for a, b in zip(s["step_with_entropy"], s["policy_step"])]
        if "step_with_entropy" in s
        else None,
        "micro_split": (
            [a - b for a, b in zip(s["step_micro_batched"], s["step_with_entropy" if algo == "ppo" else "policy_step"])]
            if "step_micro_batched" in s
            else zero
        ),
        "autocast": [entries * t for t in s["autocast_entry"]],
        "guard_probe": s["guard_probe"],
        "guard_engine": s["guard_engine"],
        "weight_copy": s["weight_copy"],
    }
    for revision, by_run in runs.items():
        body = [statistics.mean(r["training"]) for r in by_run]
        logging = [statistics.mean(r["logging"]) for r in by_run]
        out[f"body:{revision}"] = body
        out[f"logging:{revision}"] = logging
        out[f"learner:{revision}"] = [
            t + lg + g + c for t, lg, g, c in zip(body, logging, s["guard_probe"], s["weight_copy"])
        ]
    return {name: spread(v) for name, v in out.items() if v is not None}, entries


def report(result, results_dir: Path):
    """learner_cost.md from the measured result."""

    def cells(values, minimal):
        return f"{values[0]:.3g} | {values[1]:.3g} | {values[2]:.3g} | {values[0] / minimal:.2f}x"

    revisions = result["revisions"]
    summary = [
        "| algorithm | sequences x padded width | minimal s | script | loop body s | learner step s | "
        "learner / minimal | goal <= 1.1x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    details = []
    for algo, a in result["algorithms"].items():
        rows, entries = summarize(algo, a, a["runs"])
        minimal = rows["minimal"][0]
        shape = f"{a['sequences']} x {statistics.mean(a['widths']):.0f}"
        for revision in revisions:
            ratio = rows[f"learner:{revision}"][0] / minimal
            summary.append(
                f"| {algo} | {shape} | {minimal:.3g} | {revision} | {rows[f'body:{revision}'][0]:.3g} | "
                f"{rows[f'learner:{revision}'][0]:.3g} | {ratio:.2f}x | "
                f"{'met' if ratio <= 1.1 else 'not met'} |"
            )
        ppo, micro = algo == "ppo", a["micro_batch_size"]
        named = [
            (
                "minimal",
                "**minimal work**: the two rows below" if "reference" in rows else "**minimal work**: the row below",
            ),
            (
                "policy_step",
                f"{'policy and value model' if ppo else 'policy'} forward+backward of the whole batch in "
                "one micro-batch, gradient clip, AdamW step",
            ),
            ("reference", "reference forward, no gradient (the KL term)"),
        ]
        for revision in revisions:
            named += [
                (
                    f"learner:{revision}",
                    f"**learner step, sync twin at {revision}**: loop body + guard probe + weight copy + logging",
                ),
                (f"body:{revision}", f"loop body: the run's `time/training` ({revision})"),
                (f"logging:{revision}", f"logging: the run's step time outside its logged phases ({revision})"),
            ]
        named += [
            ("anchor", "extra: anchor pass, pi_old by a no-grad forward of the policy over the batch"),
            ("values", "extra: value rollout pass, V_old by a no-grad forward of the value model"),
            ("entropy", "extra: entropy in the training forward (a logged metric)"),
            (
                "micro_split",
                f"extra: micro-batches of {micro} instead of one"
                + (f" (none: {micro} >= {a['sequences']} sequences)" if micro >= a["sequences"] else ""),
            ),
            ("autocast", f"extra: `learner_autocast` at float32 (disabled), {entries} entries per step"),
            ("guard_probe", "extra: guard, learner side: `weight_check` (32-token probe)"),
            (
                "guard_engine",
                "extra: guard, engine side: `check_weight_sync` (in series in the sync twin; the async "
                "core's engine thread)",
            ),
            ("weight_copy", "extra: weight copy for the engine (async core: the state dict into host memory)"),
        ]
        checks = [
            f"- batches: mean response length per measured step, made again from version 0: "
            f"{[round(x, 3) for x in a['response_length']]}"
        ]
        for revision in revisions:
            lengths = [r["response_length"] for r in a["runs"][revision]]
            same = all(lens == a["response_length"] for lens in lengths)
            shown = [[round(x, 3) for x in lens] for lens in lengths]
            checks.append(
                f"- {revision}: the runs' {shown[0] if len(set(map(tuple, shown))) == 1 else shown}"
                f" ({'the same batches' if same else 'DIFFERENT batches: the ratio compares other tensors'})"
                f"; micro-batch: {a['runs'][revision][0]['micro_batch'] or 'not printed (script default)'}"
            )
        # step by step: a one-off cost (a step that is the first to do something) shows as one step far above its batch
        steps = range(len(a["widths"]))
        if a.get("per_batch"):  # results before 2026-12-02 kept only the means
            by_batch = [
                statistics.median(
                    sum(by[r][i] for by in a["per_batch"].values()) for r in range(len(a["per_batch"]["policy_step"]))
                )
                for i in steps
            ]
            checks.append(f"- minimal work per measured step's batch (median s): {[round(x, 1) for x in by_batch]}")
        for revision in revisions:
            by_step = [statistics.median(r["training"][i] for r in a["runs"][revision]) for i in steps]
            checks.append(f"- {revision}: loop body per measured step (median s): {[round(x, 1) for x in by_step]}")
        knobs = "".join(
            f"--{flag.replace('_', '-')} {a[flag]}, "
            for flag in ("off_policy_correction", "kl_coef")
            if a[flag] is not None
        )
        details += [
            f"### {algo}",
            "",
            f"{knobs}{a['sequences']} sequences per step, padded width "
            f"{'/'.join(map(str, a['widths']))} over the measured steps.",
            "",
            "| row | median s | min s | max s | x minimal |",
            "|---|---|---|---|---|",
            *[f"| {label} | {cells(rows[name], minimal)} |" for name, label in named if name in rows],
            "",
            *checks,
            "",
        ]
    lines = [
        "Learner cost per step against the minimal work: "
        f"{Path(result['policy']).name}, the speed table's settings, one torch thread; {result['repeats']} "
        f"repeat{'s' * (result['repeats'] != 1)} "
        f"after a warm-up, {result['warmup_steps']} warm-up + {result['measured_steps']} measured steps per run; "
        f"{result['machine']}, {result['date']}; 5-minute load average {result['load_average'][0]:.1f} at the "
        f"start, {result['load_average'][1]:.1f} at the end (on an idle machine, under 1).",
        f"Produced by `{result['command']}`.",
        "",
        "Minimal work: one forward+backward of the policy over the batch in one micro-batch and the update (PPO: with "
        "its value model), plus the reference's no-grad forward where the loss has a KL term; the reward model scores "
        "in the generation thread and is not counted. Learner step: the sync twin's `time/training` (same loop body "
        "as the async core) + guard probe + weight copy + logging. Extras: each timed alone on the same batches.",
        "",
        *summary,
        "",
        *details,
    ]
    (results_dir / "learner_cost.md").write_text("\n".join(lines))
    return "\n".join(lines)


def check_flags(args: Args):
    """Bad flags fail in one line naming the flag, before any model loads."""
    unknown = [a for a in args.algorithms if a not in speed.TABLE]
    if unknown:
        sys.exit(f"error: unknown --algorithms {unknown}; known: {speed.TABLE}")
    if args.repeats < 1 or args.measured_steps < 1 or args.warmup_steps < 1:
        sys.exit("error: --repeats, --measured-steps and --warmup-steps must be >= 1")
    if args.micro_batch_memory_gib is not None and args.micro_batch_memory_gib <= 0:
        sys.exit(
            f"error: --micro-batch-memory-gib must be > 0 (or None: the scripts' default), got "
            f"{args.micro_batch_memory_gib}"
        )
    for revision in args.revisions:
        if (
            revision != "worktree"
            and subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                capture_output=True,
            ).returncode
        ):
            sys.exit(f"error: --revisions {revision!r} is neither worktree nor a commit of this repository")
    if len(set(args.revisions)) != len(args.revisions):
        sys.exit(f"error: --revisions {args.revisions} names a revision twice")


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:  # shrinks only what was left at its default: explicit flags win
        defaults = Args()
        args.repeats = 1 if args.repeats == defaults.repeats else args.repeats
        args.measured_steps = 1 if args.measured_steps == defaults.measured_steps else args.measured_steps
        args.warmup_steps = 1 if args.warmup_steps == defaults.warmup_steps else args.warmup_steps
    check_flags(args)
    inputs = speed.Args(
        policy=args.policy, reward_model=args.reward_model, prompts=args.prompts, work_dir=args.work_dir
    )
    speed.prepare_inputs(inputs)
    args.policy, args.reward_model, args.prompts = inputs.policy, inputs.reward_model, inputs.prompts
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()[1]]  # the 5-minute load average, recorded because other work on the cores slows every row
    runs = {algo: {revision: [] for revision in args.revisions} for algo in args.algorithms}
    for repeat in range(1, args.repeats + 1):  # interleaved: a slow drift of the machine hits every script alike
        for algo in args.algorithms:
            for revision in args.revisions:
                runs[algo][revision].append(run_script(args, algo, revision, repeat))
    rows = measure_rows(args)
    load.append(os.getloadavg()[1])
    result = dict(
        load_average=load,
        command="python benchmark/learner_cost.py " + " ".join(sys.argv[1:]),
        policy=args.policy,
        repeats=args.repeats,
        warmup_steps=args.warmup_steps,
        measured_steps=args.measured_steps,
        revisions=args.revisions,
        settings={algo: script_flags(args, algo) for algo in args.algorithms},
        algorithms={algo: dict(rows[algo], runs=runs[algo]) for algo in args.algorithms},
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
    )
    (results_dir / "learner_cost.json").write_text(json.dumps(result, indent=1))
    print(report(result, results_dir))
