"""Overheads of the async hand-off, piece by piece, and our generation against a bare `llm.generate`.

    python benchmark/overheads.py                         # SmolLM2-135M-Instruct, the speed table's DPO step; ~5 min
    python benchmark/overheads.py --num-samples-per-prompt 6 --repeats 10
    python benchmark/overheads.py --quick --policy P --neox-policy N --prompts F --results-dir D  # the tests' run

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
Each is timed --repeats times, interleaved; the table gives median, min and max.

Then the push paths (issue 43): one policy version W' = W + 1e-3 N(0, 1) into the engine by each public way, timed
--repeats times, interleaved, on the policy and on a GPT-NeoX model (vLLM serves it through its Transformers backend):
  (a) reload_weights   `collective_rpc("reload_weights", ...)`, the scripts' push_weights_to_engine
  (b) load_weights     `collective_rpc(fn)`, fn calling the worker's model's own `load_weights` (TRL, OpenRLHF)
  (c) in-place copy_   `param.data.copy_` into every engine parameter whose name (after the model's own HF-to-vLLM
                       renaming) and shape match; the rest, fused q/k/v and gate/up, through `load_weights`
  (d) floor            the state dict's tensors copied into preallocated tensors of the same shapes, in this process
A path is correct if, after it, the engine's prompt logprobs of a 32-token probe equal the learner's (float32) with
W' within 1e-4 and have moved as far as the learner's. One reload runs under cProfile, to split out vLLM's processing
step. One JSON and one table: results/overheads/overheads.json, results/overheads/overheads.md.
"""

import cProfile
import dataclasses
import gc
import json
import os
import platform
import pstats
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tyro

import common

REPO = common.REPO


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
    results_dir: str = str(REPO / "benchmark" / "results" / "overheads")
    """where overheads.json and overheads.md go"""
    work_dir: str = str(REPO / "benchmark" / "work")
    """scratch space (git-ignored) for the speed table's prompt file"""
    neox_policy: Optional[str] = None
    """GPT-NeoX model folder for the push paths; None: a random GPT-NeoX of Pythia-160M's shape with the policy's
    tokenizer, built once under --work-dir"""
    quick: bool = False
    """smoke mode for the test suite: 2 repeats"""


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


# PUSH PATHS (issue 43): every public way to put a policy version into the engine, and the copy they all contain
SYNC_TOLERANCE = 1e-4  # float32 rounding of the probe's logprobs, engine against learner: up to 7e-5 (SmolLM2)


def build_neox(tokenizer_path: str, folder: Path):
    """A random GPT-NeoX of Pythia-160M's shape (the paper's TL;DR family) with `tokenizer_path`'s tokenizer, made once:
    the push paths need a model of realistic width served by vLLM's Transformers backend, not trained weights."""
    if not (folder / "config.json").exists():
        import torch
        from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        torch.manual_seed(0)
        config = GPTNeoXConfig(
            vocab_size=50304,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            rotary_pct=0.25,
            use_parallel_residual=True,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        GPTNeoXForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def load_weights_push(llm, weights):
    """(b) The model's own `load_weights` (HF names in, fused q/k/v and gate/up out), as TRL's and OpenRLHF's worker
    extensions call it; they send one tensor per call, here all go in one."""
    llm.collective_rpc(
        lambda worker, weights: worker.get_model().load_weights(weights), kwargs=dict(weights=list(weights.items()))
    )
    llm.reset_prefix_cache()


def in_place_push(llm, weights, copied: list):
    """(c) `copy_` into every engine parameter whose name and shape match; the rest through `load_weights`. Appends
    the names copied to `copied` (the engine runs in this process, so the worker's list is this list)."""

    def load(worker, weights):
        model = worker.get_model()
        params = dict(model.named_parameters())
        mapper = getattr(model, "hf_to_vllm_mapper", None)  # the Transformers backend's renaming (gpt_neox. -> model.)
        rest = []
        for name, tensor in weights:
            param = params.get(mapper.map_name(name) if mapper else name)
            if param is not None and param.shape == tensor.shape:
                param.data.copy_(tensor)
                copied.append(name)
            else:
                rest.append((name, tensor))
        model.load_weights(rest)

    llm.collective_rpc(load, kwargs=dict(weights=list(weights.items())))
    llm.reset_prefix_cache()


def push_paths(dpo, llm, policy, probe, run, repeats: int):
    """Time each push path and check that the engine then answers as the learner does (module docstring)."""
    import torch
    import torch.nn.functional as F
    from vllm import SamplingParams

    def engine_logprobs():
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        output = llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0]
        return torch.tensor([lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], probe[1:])])

    def learner_logprobs(weights):
        policy.load_state_dict(weights)
        return dpo.weight_check(policy, probe, run)[1]

    # W and W' = W + 1e-3 N(0, 1), tied names (SmolLM2's lm_head and embedding) sharing one tensor as in the learner
    generator, pairs = torch.Generator().manual_seed(0), {}
    state = policy.state_dict()
    for t in state.values():
        if t.data_ptr() not in pairs:
            pairs[t.data_ptr()] = t.detach().clone(), t.detach() + 1e-3 * torch.randn(t.shape, generator=generator)
    before = {name: pairs[t.data_ptr()][0] for name, t in state.items()}
    after = {name: pairs[t.data_ptr()][1] for name, t in state.items()}
    learner_before, learner_after = learner_logprobs(before), learner_logprobs(after)
    shift = (learner_after - learner_before).abs().max().item()
    if shift < 100 * SYNC_TOLERANCE:
        sys.exit(f"error: W' moves the learner's probe logprobs by only {shift:.1e}, too little to tell a push")
    unique = list({t.data_ptr(): t for t in after.values()}.values())
    floor_copies = [torch.empty_like(t) for t in unique]
    copied = []
    paths = {
        "(a) reload_weights": lambda: dpo.push_weights_to_engine(llm, after),
        "(b) load_weights": lambda: load_weights_push(llm, after),
        "(c) in-place copy_": lambda: (copied.clear(), in_place_push(llm, after, copied)),
        "(d) floor: copy into preallocated tensors": lambda: [d.copy_(t) for d, t in zip(floor_copies, unique)],
    }

    def restore():
        """Every engine path starts from W, served correctly, whatever the previous path left half done."""
        dpo.push_weights_to_engine(llm, before)

    checks = {}
    for name, push in paths.items():
        if name.startswith("(d)"):
            continue
        restore()
        served_before, error = engine_logprobs(), None
        try:
            push()
        except Exception as e:  # noqa: BLE001 -- a path that fails is a finding, not a crash: its message is reported
            error = f"{type(e).__name__}: {e}"
        served = engine_logprobs()
        gap, moved = (served - learner_after).abs().max().item(), (served - served_before).abs().max().item()
        checks[name] = dict(
            correct=error is None and gap <= SYNC_TOLERANCE and moved >= shift / 2,
            error=error,
            gap_to_learner=gap,
            moved=moved,
            gap_before=(served_before - learner_before).abs().max().item(),
        )
        if name.startswith("(c)"):
            checks[name].update(
                copied=len(copied),
                tensors=len(after),
                copied_kinds=sorted({".".join(n.split(".")[-2:]) for n in copied}),
            )
            # what the engine serves if it computes with the copied tensors, but with its linear layers (the output
            # layer too) as at their last repack: the CPU backend computes them from packed copies it made at load
            linears = {f"{n}.weight" for n, m in policy.named_modules() if isinstance(m, torch.nn.Linear)}
            output = next(n for n, m in policy.named_modules() if m is policy.get_output_embeddings()) + ".weight"
            mix = {n: after[n] if n in copied and n not in linears else before[n] for n in before}
            if policy.get_input_embeddings().weight is policy.get_output_embeddings().weight:  # tied
                mix[output] = mix[
                    next(n for n, m in policy.named_modules() if m is policy.get_input_embeddings()) + ".weight"
                ]
            with torch.no_grad():
                policy.load_state_dict(mix)
                ids = torch.tensor([probe])
                logits = F.linear(policy.base_model(input_ids=ids).last_hidden_state, before[output])
                mixed = F.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            checks[name]["gap_to_stale_linears"] = (served - mixed).abs().max().item()

    # a path that does not serve W' has no push time to report: it is not timed
    timed = {name: push for name, push in paths.items() if name not in checks or checks[name]["correct"]}
    seconds = {name: [] for name in paths}
    for i in range(repeats + 1):  # round 0 warms each path up and is dropped
        for name, push in timed.items():
            if name in checks:
                restore()
            start = time.perf_counter()
            push()
            if i > 0:
                seconds[name].append(time.perf_counter() - start)

    # vLLM logs "Reloading and processing weights took ..." once per process, as one number: cProfile splits it
    restore()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(dpo.push_weights_to_engine, llm, after)
    profiled = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    processing = sum(
        entry[3] for (_, _, function), entry in stats.items() if function == "process_weights_after_loading"
    )
    copies = sum(entry[2] for (_, _, function), entry in stats.items() if "'copy_'" in function)
    policy.load_state_dict(before)
    restore()
    return dict(
        seconds=seconds,
        checks=checks,
        learner_shift=shift,
        bytes=sum(t.nbytes for t in unique),
        parameters=sum(t.numel() for t in unique),
        reload_profile=dict(total=profiled, processing=processing, tensor_copies=copies),
    )


def measure(args: Args):
    """Time every piece --repeats times, interleaved (round 0 warms each up and is dropped)."""
    import speed  # the speed table's inputs: the same prompt file, made the same way

    inputs = speed.Args(policy=args.policy, prompts=args.prompts, work_dir=args.work_dir)
    speed.prepare_inputs(inputs)
    dpo = common.load_script("multigpu/async_dpo_multigpu.py")  # the variant with the spare-copy hand-off
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    run = dpo.RunArgs(
        model_name_or_path=inputs.policy,
        dataset_name=inputs.prompts,
        prompts_per_step=args.prompts_per_step,
        num_samples_per_prompt=args.num_samples_per_prompt,
        response_length=args.response_length,
        max_prompt_tokens=args.max_prompt_tokens,
        torch_threads=1,
    )
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
        params = [
            SamplingParams(
                n=k,
                temperature=run.temperature,
                max_tokens=run.response_length,
                **(dict(seed=(run.seed * 1_000_003 + (step * n + j) * k) % 2**31, detokenize=False) if seeded else {}),
            )
            for j in range(n)
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_of(step)], params, use_tqdm=False)
        return [list(s.token_ids) for o in outputs for s in o.outputs]

    responses, logprobs = dpo.generate(llm, prompts_of(0), run, 0)
    batch = dict(prompts=prompts_of(0), responses=responses, behaviour_logprobs=logprobs)  # a batch's bulk
    pieces = {
        "learner: full_state_dict": lambda i: dpo.full_state_dict(policy, run),
        "learner: weight_check (guard)": lambda i: dpo.weight_check(policy, probe, run),
        "learner: copy_for_engine, into a loaded copy": lambda i: dpo.copy_for_engine(
            dpo.full_state_dict(policy, run), spare_weights, run
        ),
        "learner: copy_for_engine, fresh": lambda i: dpo.copy_for_engine(
            dpo.full_state_dict(policy, run), queue.Queue(), run
        ),
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
    push = {Path(inputs.policy).name: push_paths(dpo, llm, policy, probe, run, args.repeats)}
    # the second model gets an engine of its own (the first one freed); its learner model is loaded before it, as
    # vLLM's Transformers backend patches GPT-NeoX's class when it builds the engine (docs/async.md, decision 12)
    llm = None
    gc.collect()
    neox_path = args.neox_policy or build_neox(inputs.policy, Path(args.work_dir) / "neox-160m-random")
    neox_run = dataclasses.replace(run, model_name_or_path=str(neox_path))
    neox = AutoModelForCausalLM.from_pretrained(neox_path, dtype=torch.float32).eval()
    neox_llm = dpo.build_engine(neox_run)
    dpo.keep_models_eager(neox)
    push[Path(neox_path).name] = push_paths(dpo, neox_llm, neox, probe, neox_run, args.repeats)
    return dict(
        seconds=seconds,
        tokens=tokens,
        policy=inputs.policy,
        repeats=args.repeats,
        push_paths=push,
        parameters=sum(p.numel() for p in policy.parameters()),
        settings=dict(
            prompts_per_step=n,
            num_samples_per_prompt=k,
            response_length=run.response_length,
            temperature=run.temperature,
            torch_threads=1,
        ),
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
    )


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
        "Produced by `python benchmark/overheads.py`.",
        "",
        "| piece | median s | min s | max s |",
        "|---|---|---|---|",
        *[f"| {name} | {spread(values)} |" for name, values in seconds.items()],
        "",
        "Generation throughput, sampled tokens per second over all repeats:",
        "",
        "| call | tokens/s | ours / this call |",
        "|---|---|---|",
        *[f"| {name} | {rate[name]:.0f} | {rate['generate: ours'] / rate[name]:.3f} |" for name in rate],
    ]
    lines += push_paths_report(result["push_paths"])
    (results_dir / "overheads.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def push_paths_report(push):
    """The push paths table: seconds, multiples of the copy floor, and whether the engine then serves W'."""
    lines = [
        "",
        "## Push paths",
        "",
        "One policy version W' = W + 1e-3 N(0, 1) pushed into the engine four ways, timed in the same rounds "
        "after a warm-up (every engine path starts from W, restored by reload_weights, untimed). Correct: the "
        "engine's prompt logprobs of the 32-token probe equal the learner's (float32) within "
        f"{SYNC_TOLERANCE:g} and moved as far as the learner's did. x floor: median over median, min over min.",
        "",
        "| model | path | median s | min s | x floor (median) | x floor (min) | correct | max logprob gap to "
        "learner (moved; learner moved) | what happens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, r in push.items():
        floor = r["seconds"]["(d) floor: copy into preallocated tensors"]
        for name, values in r["seconds"].items():
            check = r["checks"].get(name)
            timing = values and (
                f"{statistics.median(values):.3g} | {min(values):.3g} | "
                f"{statistics.median(values) / statistics.median(floor):.1f} | "
                f"{min(values) / min(floor):.1f}"
            )
            if check is None:
                lines.append(
                    f"| {model} | {name} | {timing} | - | - | {r['bytes'] / 2**20:.0f} MiB, "
                    f"{r['parameters'] / 1e6:.3g}M parameters |"
                )
                continue
            error = (check["error"] or "")[:110].replace("|", "/")
            what = "serves W'" if check["correct"] else f"raises {error}" if error else "serves other weights"
            if "copied" in check:
                what = (
                    f"copies {check['copied']} of {check['tensors']} tensors in place "
                    f"({', '.join(check['copied_kinds'])}); "
                    + what
                    + (
                        ""
                        if check["correct"]
                        else "; then serves W' where it copied, but W in every linear "
                        f"layer, the output layer too (gap to that mix {check['gap_to_stale_linears']:.1e})"
                    )
                )
            if check["correct"]:
                lines.append(
                    f"| {model} | {name} | {timing} | yes | {check['gap_to_learner']:.1e} "
                    f"({check['moved']:.2g}; {r['learner_shift']:.2g}) | {what} |"
                )
            else:  # not timed: a wrong push's time is not a push's cost
                lines.append(
                    f"| {model} | {name} | - | - | - | - | **no** | {check['gap_to_learner']:.1e} "
                    f"({check['moved']:.2g}; {r['learner_shift']:.2g}) | {what} |"
                )
    lines += [
        "",
        "reload_weights under cProfile, one call (profiling slows its Python parts): processing is "
        "`process_weights_after_loading` (on CPU, repacking every linear layer for oneDNN), tensor copies are "
        "`copy_` (the loaders' copies into fresh tensors, then back into the engine's own):",
        "",
        "| model | profiled s | processing s (share) | tensor copies s (share) |",
        "|---|---|---|---|",
    ]
    for model, r in push.items():
        p = r["reload_profile"]
        lines.append(
            f"| {model} | {p['total']:.3g} | {p['processing']:.3g} ({p['processing'] / p['total']:.0%}) | "
            f"{p['tensor_copies']:.3g} ({p['tensor_copies'] / p['total']:.0%}) |"
        )
    return lines


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        args.repeats = 2
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    (results_dir / "overheads.json").write_text(json.dumps(result, indent=1))
    print(report(result, results_dir))
