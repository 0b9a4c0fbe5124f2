"""Overheads of the async hand-off, piece by piece, and our generation against a bare `llm.generate`.

    python benchmark/overheads.py                         # SmolLM2-135M-Instruct, the speed table's DPO step; ~5 min
    python benchmark/overheads.py --num-samples-per-prompt 6 --repeats 10
    python benchmark/overheads.py --quick --policy P --prompts F --results-dir D   # the test suite's smoke run

Every piece is the scripts' own function (loaded from async_dpo.py; `tests/test_twins.py` keeps them identical in all
eight scripts), run on a real engine and learner model with one torch thread per role, as in an async run:
  learner   full_state_dict (the weights for the engine), weight_check (the guard's probe logprobs), copy_for_engine
            (the copy the learner hands over, since it trains on while the engine loads it: into a copy the engine
            has loaded, as in a run, and a fresh one, as before the first copy comes back)
  hand-off  a batch through a queue.Queue from one thread to another, as the generation thread gives it to the learner
  engine    push_weights_to_engine (vLLM's in-place reload_weights + prefix-cache reset), check_weight_sync (the
            guard: the engine's logprobs of the probe)
  generate  our `generate` (a seed per request, the sampled tokens' logprobs) against `llm.generate` with the same
            seeds and no logprobs (the same tokens: only the logprobs differ), and with vLLM's defaults (no seed)
Each is timed --repeats times, interleaved; the table gives median, min and max. One JSON and one table:
results/overheads.json, results/overheads.md.
"""

import json
import os
import platform
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tyro

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmark"))


@dataclass
class Args:
    policy: Optional[str] = None
    """policy model folder; None: models/SmolLM2-135M-Instruct (made by install.sh)"""
    prompts: Optional[str] = None
    """prompt JSONL with a `query` field; None: the speed table's (made once under benchmark/work)"""
    prompts_per_step: int = 4
    """prompts per generation call (the speed table's DPO step)"""
    num_samples_per_prompt: int = 2
    """samples per prompt"""
    response_length: int = 48
    """maximum new tokens per sample"""
    max_prompt_tokens: int = 128
    """prompts longer than this are dropped, as in the scripts"""
    repeats: int = 7
    """timings per piece (after one untimed warm-up of each)"""
    results_dir: str = str(REPO / "benchmark" / "results")
    """where overheads.json and overheads.md go"""
    work_dir: str = str(REPO / "benchmark" / "work")
    """scratch space (git-ignored) for the speed table's prompt file"""
    quick: bool = False
    """smoke mode for the test suite: 2 repeats"""


def load_script(relative_path: str):
    """Import a script as a module (its `if __name__ == "__main__":` body does not run)."""
    import importlib.util

    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hand_off_seconds(batch):
    """One batch from a producer thread to a consumer thread through a queue, as the generation thread hands it over
    (put, then the learner's get); the consumer is already waiting, as a learner starved of data is."""
    q, received = queue.Queue(maxsize=1), []
    consumer = threading.Thread(target=lambda: received.append((q.get(), time.perf_counter())))
    consumer.start()
    time.sleep(0.05)  # the consumer is blocked in get
    start = time.perf_counter()
    q.put(batch)
    consumer.join()
    return received[0][1] - start


def measure(args: Args):
    """Time every piece --repeats times, interleaved (round 0 warms each up and is dropped)."""
    import speed  # the speed table's inputs: the same prompt file, made the same way

    inputs = speed.Args(policy=args.policy, prompts=args.prompts, work_dir=args.work_dir)
    speed.prepare_inputs(inputs)
    dpo = load_script("multigpu/async_dpo_multigpu.py")  # the variant with the spare-copy hand-off
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    run = dpo.Args(model_name_or_path=inputs.policy, dataset_name=inputs.prompts,
                   prompts_per_step=args.prompts_per_step, num_samples_per_prompt=args.num_samples_per_prompt,
                   response_length=args.response_length, max_prompt_tokens=args.max_prompt_tokens, torch_threads=1)
    run.engine_device = run.learner_device = "cpu"
    run.kv_cache_gib, run.gpu_memory_utilization = 1.0, 0.1  # the scripts' CPU defaults
    dpo.SET_TORCH_THREADS(1)
    tokenizer, run.eos_token_ids = dpo.load_tokenizer(run)
    prompts, _ = dpo.load_prompts(run, tokenizer)
    policy = AutoModelForCausalLM.from_pretrained(inputs.policy, dtype=torch.float32).eval()
    llm = dpo.build_engine(run)
    dpo.keep_models_eager(policy)
    probe = (prompts[0] * 32)[:32]  # as the scripts make theirs
    k, n = run.num_samples_per_prompt, run.prompts_per_step

    def prompts_of(step):
        return [prompts[(step * n + j) % len(prompts)] for j in range(n)]

    def ours(step):
        return dpo.generate(llm, prompts_of(step), run, step)[0]  # the responses

    def bare(step, seeded):
        """llm.generate as a user would call it; `seeded`: with the seeds `generate` gives each request."""
        params = [SamplingParams(n=k, temperature=run.temperature, max_tokens=run.response_length,
                                 **(dict(seed=(run.seed * 1_000_003 + (step * n + j) * k) % 2**31, detokenize=False)
                                    if seeded else {}))
                  for j in range(n)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_of(step)], params, use_tqdm=False)
        return [list(s.token_ids) for o in outputs for s in o.outputs]

    responses, logprobs = dpo.generate(llm, prompts_of(0), run, 0)
    batch = dict(prompts=prompts_of(0), responses=responses, behaviour_logprobs=logprobs)  # a batch's bulk
    pieces = {
        "learner: full_state_dict": lambda i: dpo.full_state_dict(policy, run),
        "learner: weight_check (guard)": lambda i: dpo.weight_check(policy, probe, run),
        "learner: copy_for_engine, into a loaded copy": lambda i: dpo.copy_for_engine(
            dpo.full_state_dict(policy, run), spare_weights, run),
        "learner: copy_for_engine, fresh": lambda i: dpo.copy_for_engine(
            dpo.full_state_dict(policy, run), queue.Queue(), run),
        # a cut measured and not made: a shorter probe leaves bfloat16's rounding too little room (docs/async.md)
        "alternative: weight_check, 8-token probe": lambda i: dpo.weight_check(policy, probe[:8], run),
        "hand-off: a batch through the queue": None,  # timed inside hand_off_seconds
        "engine: push_weights_to_engine": lambda i: dpo.push_weights_to_engine(llm, dpo.full_state_dict(policy, run)),
        "engine: check_weight_sync (guard)": lambda i: dpo.check_weight_sync(llm, check, None, run, i),
        "generate: ours": ours,
        "generate: bare, same seeds": lambda i: bare(i, True),
        "generate: bare, vLLM defaults": lambda i: bare(i, False),
    }
    check = dpo.weight_check(policy, probe, run)
    spare_weights = queue.Queue()  # holds one loaded copy, taken and given back each round as in a run
    spare_weights.put({name: t.detach().clone() for name, t in dpo.full_state_dict(policy, run).items()})
    seconds = {name: [] for name in pieces}
    tokens = {name: [] for name in pieces if name.startswith("generate")}
    outputs = {}
    for i in range(args.repeats + 1):
        for name, fn in pieces.items():
            if fn is None:
                t, out = hand_off_seconds(batch), None
            else:
                start = time.perf_counter()
                out = fn(i)
                t = time.perf_counter() - start
            outputs[name] = out
            if name == "learner: copy_for_engine, into a loaded copy":
                spare_weights.put(out)  # back, as the generation thread gives it back once loaded
            if i > 0:
                seconds[name].append(t)
                if name in tokens:
                    tokens[name].append(sum(map(len, out)))
        # the fair comparison: with the same seeds vLLM samples the same tokens with or without logprobs
        if outputs["generate: ours"] != outputs["generate: bare, same seeds"]:
            sys.exit("error: ours and the bare call with the same seeds sampled different tokens")
    return dict(seconds=seconds, tokens=tokens, policy=inputs.policy, repeats=args.repeats,
                parameters=sum(p.numel() for p in policy.parameters()), settings=dict(
                    prompts_per_step=n, num_samples_per_prompt=k, response_length=run.response_length,
                    temperature=run.temperature, torch_threads=1),
                date=time.strftime("%Y-%m-%d %H:%M"), machine=f"{platform.machine()}, {os.cpu_count()} cores")


def report(result, results_dir: Path):
    """overheads.md from the measured result."""
    def spread(values):
        return f"{statistics.median(values):.3g} | {min(values):.3g} | {max(values):.3g}"

    seconds, tokens, settings = result["seconds"], result["tokens"], result["settings"]
    rate = {name: sum(tokens[name]) / sum(seconds[name]) for name in tokens}
    lines = [
        f"Overheads of one policy version's hand-off, and generation throughput: {result['repeats']} repeats after a "
        "warm-up, one torch thread per role",
        f"({Path(result['policy']).name}, {result['parameters'] / 1e6:.0f}M parameters; "
        f"{settings['prompts_per_step']} prompts x {settings['num_samples_per_prompt']} samples of at most "
        f"{settings['response_length']} tokens, temperature {settings['temperature']}; {result['machine']}, "
        f"{result['date']}).",
        "Produced by `python benchmark/overheads.py`.", "",
        "| piece | median s | min s | max s |", "|---|---|---|---|",
        *[f"| {name} | {spread(values)} |" for name, values in seconds.items()], "",
        "Generation throughput, sampled tokens per second over all repeats:", "",
        "| call | tokens/s | ours / this call |", "|---|---|---|",
        *[f"| {name} | {rate[name]:.0f} | {rate['generate: ours'] / rate[name]:.3f} |" for name in rate],
    ]
    (results_dir / "overheads.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        args.repeats = 2
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    (results_dir / "overheads.json").write_text(json.dumps(result, indent=1))
    print(report(result, results_dir))
