"""One policy version's hand-off to the engine, full weights against a LoRA adapter (issue 56, item 6): time and bytes.

    python benchmark/lora_handoff.py                      # models/SmolLM2-135M-Instruct (made by install.sh); ~5 min
    python benchmark/lora_handoff.py --ranks 1 16 64 --versions 6 --note "what else ran on the machine"
    python benchmark/lora_handoff.py --quick --policy P --results-dir D --work-dir W  # a smoke run
    python benchmark/lora_handoff.py --report-only        # the table again from results/lora_handoff/lora_handoff.json

Every piece is the scripts' own function, on a real CPU engine in float32 and a float32 learner, one torch thread:
  full      async_dpo.py: the learner's host copy of its state dict and weight_check (the guard's probe logprobs and
            checksums), then the engine's push_weights_to_engine (vLLM's reload_weights) and check_weight_sync
  lora-R    async_dpo_lora.py at --lora-rank R: the learner's save_adapter (the adapter's safetensors, in /dev/shm
            where there is one, with the probe logprobs and checksums), then the engine's push_weights_to_engine
            (add_lora of this version, remove_lora of the previous one) and check_weight_sync
Each mode runs in its own process (one engine per process). The learner makes one AdamW step (its script's default
learning rate) on a fixed random batch of token ids between versions, so every version differs from the one before;
version 0 is pushed untimed, versions 1..--versions are timed and the first of them is dropped as a warm-up. Bytes
handed over: the state dict's tensors (what the copy and reload_weights carry) against the adapter file's size.
Then, by calculation only, the adapter (all attention and MLP projections, rank --calc-rank) and the full weights of
Pythia-2.8B and Llama-3.1-8B from their published config.json values. One JSON and one table:
results/lora_handoff/lora_handoff.json, results/lora_handoff/lora_handoff.md.
"""

import atexit
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
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
    """policy model folder (a Llama-style model, as the LoRA variant requires); None: models/SmolLM2-135M-Instruct"""
    ranks: tuple[int, ...] = (1, 16, 64)
    """LoRA ranks measured, each against the full-weight hand-off"""
    versions: int = 6
    """timed policy versions per mode; the first is dropped as a warm-up"""
    batch_size: int = 4
    """sequences of the fixed random batch the learner steps on between versions"""
    batch_tokens: int = 64
    """tokens per sequence of that batch"""
    max_prompt_tokens: int = 128
    """the engine's prompt room (the probe is 32 tokens, the generation prompts ~12; the tiny test models hold 512)"""
    generate_prompts: int = 8
    """prompts of the generation timing (2 samples each, the script's temperature and response length)"""
    generate_repeats: int = 3
    """timed generation batches per mode, after one untimed"""
    calc_rank: int = 16
    """LoRA rank of the calculated sizes of the large models"""
    results_dir: str = str(REPO / "benchmark" / "results" / "lora_handoff")
    """where lora_handoff.json and lora_handoff.md go"""
    work_dir: str = str(REPO / "benchmark" / "work" / "lora_handoff")
    """scratch space (git-ignored): each mode's JSON"""
    note: str = ""
    """a sentence for the report on the machine's state (e.g. what else was running)"""
    scripts_ref: str = "HEAD"
    """git revision the two scripts are read from (`git show REF:async_dpo.py`), resolved once to a commit for every
    mode: the numbers belong to committed code, not to a working tree others may be editing; "": the working tree"""
    quick: bool = False
    """smoke mode for the test suite: 2 versions, the ranks given, one timed generation batch of 2 prompts"""
    report_only: bool = False
    """rebuild lora_handoff.md from --results-dir's lora_handoff.json (the measured numbers), measuring nothing"""
    mode: Optional[str] = None
    """internal: measure this one mode ("full" or "lora-R") in this process and write its JSON into --work-dir"""


def policy_path(args: Args):
    return args.policy or str(REPO / "models" / "SmolLM2-135M-Instruct")


def measure_mode(args: Args):
    """One mode, in this process: version 0 pushed untimed, then per version a learner step (untimed) and the timed
    hand-off, its learner side and its engine side, with the bytes it hands over."""
    lora = args.mode.startswith("lora-")
    script = common.load_script("async_dpo_lora.py" if lora else "async_dpo.py", args.scripts_ref, Path(args.work_dir))
    import torch

    script.SET_TORCH_THREADS(1)
    flags = dict(lora_rank=int(args.mode.split("-")[1])) if lora else {}
    run = script.RunArgs(
        model_name_or_path=policy_path(args), torch_threads=1, max_prompt_tokens=args.max_prompt_tokens, **flags
    )
    run.engine_device = run.learner_device = "cpu"
    if lora:
        script.check_lora_args(run)  # a rank vLLM serves, modules it applies
    tokenizer, run.eos_token_ids = script.load_tokenizer(run)
    # the guard's probe, as the scripts make theirs (a prompt repeated to 32 ids), and a batch of other ids to train on
    probe = (tokenizer("Summarize the following post in one sentence. TL;DR:").input_ids * 32)[:32]
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, len(tokenizer), (args.batch_size, args.batch_tokens), generator=generator)
    start = time.perf_counter()
    policy = script.load_lora_policy(run) if lora else script.load_causal_lm(run.model_name_or_path, "cpu")
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=run.learning_rate, eps=1e-5, weight_decay=run.weight_decay)
    llm = script.build_engine(run)
    script.keep_models_eager(policy)
    setup_seconds = time.perf_counter() - start

    if lora:
        run.adapter_dir = tempfile.mkdtemp(prefix="adapters_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        atexit.register(shutil.rmtree, run.adapter_dir, True)  # RAM: given back at exit, a failure's too
        expected = script.save_adapter(policy, 0, probe, run)
        script.push_weights_to_engine(llm, script.adapter_request(run, 0), None)
        guard_state = script.check_weight_sync(llm, expected, None, run, 0, script.adapter_request(run, 0))
    else:
        guard_state = script.check_weight_sync(llm, script.weight_check(policy, probe, run), None, run, 0)

    rows = []
    for version in range(1, args.versions + 1):
        optimizer.zero_grad()
        policy(input_ids=batch, labels=batch).loss.backward()  # one small step: version `version` differs
        optimizer.step()
        row = dict(version=version)
        t0 = time.perf_counter()
        if lora:
            expected = script.save_adapter(policy, version, probe, run)
            t1 = time.perf_counter()
            adapter = script.adapter_request(run, version)
            row["bytes"] = os.path.getsize(os.path.join(adapter.lora_path, "adapter_model.safetensors"))
            row["folder_bytes"] = sum(f.stat().st_size for f in Path(adapter.lora_path).iterdir())
            t2 = time.perf_counter()
            script.push_weights_to_engine(llm, adapter, script.adapter_request(run, version - 1))
            t3 = time.perf_counter()
            guard_state = script.check_weight_sync(llm, expected, guard_state, run, version, adapter)
            t4 = time.perf_counter()
            row.update(learner=t1 - t0)
        else:
            weights = {name: t.detach().to("cpu", copy=True) for name, t in policy.state_dict().items()}
            tc = time.perf_counter()
            expected = script.weight_check(policy, probe, run)
            t1 = time.perf_counter()
            row["bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
            row["unique_bytes"] = sum(
                t.numel() * t.element_size() for t in {t.data_ptr(): t for t in policy.state_dict().values()}.values()
            )
            t2 = time.perf_counter()
            script.push_weights_to_engine(llm, weights)
            t3 = time.perf_counter()
            guard_state = script.check_weight_sync(llm, expected, guard_state, run, version)
            t4 = time.perf_counter()
            row.update(learner=t1 - t0, copy=tc - t0, weight_check=t1 - tc, tensors=len(weights))
        row.update(push=t3 - t2, guard=t4 - t3, engine=(t3 - t2) + (t4 - t3))
        row["total"] = row["learner"] + row["engine"]
        rows.append(row)
        print(f"{args.mode} version {version}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    # generation by the last version (LoRA: through its adapter), what the adapter costs the engine in every batch
    last = script.adapter_request(run, args.versions) if lora else None
    prompts = [tokenizer(f"Write one sentence about the number {i}.").input_ids for i in range(args.generate_prompts)]
    generation = []
    for step in range(args.generate_repeats + 1):  # the first: untimed
        t0 = time.perf_counter()
        responses = script.generate(llm, prompts, run, step, *([last] if lora else []))[0]
        seconds = time.perf_counter() - t0
        if step:
            generation.append(dict(seconds=seconds, tokens=sum(map(len, responses)), sequences=len(responses)))
    return dict(
        mode=args.mode,
        script="async_dpo_lora.py" if lora else "async_dpo.py",
        generation=generation,
        prompt_tokens=sum(map(len, prompts)),
        scripts_commit=args.scripts_ref or "working tree",
        learning_rate=run.learning_rate,
        trained_parameters=sum(p.numel() for p in trained),
        parameters=sum(p.numel() for p in {p.data_ptr(): p for p in policy.parameters()}.values()),
        setup_seconds=setup_seconds,
        adapter_dir=run.adapter_dir if lora else None,
        peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        rows=rows,
    )


# CALCULATION: adapter and full-weight sizes of the large models, from their published config.json values
LARGE_MODELS = {
    "Pythia-2.8B": dict(
        source="EleutherAI/pythia-2.8b config.json (GPTNeoXForCausalLM)",
        hidden_size=2560,
        num_hidden_layers=32,
        intermediate_size=10240,
        num_attention_heads=32,
        num_key_value_heads=32,  # GPT-NeoX has no GQA: the fused query_key_value is 3 x hidden wide
        vocab_size=50304,
        tie_word_embeddings=False,
        biases=True,  # every GPT-NeoX linear layer has a bias; LayerNorm has weight and bias
        published_parameters=2_775_208_960,  # the Pythia paper's (Biderman et al., 2023) table: total parameters
        projections="query_key_value, dense, dense_h_to_4h, dense_4h_to_h",
    ),
    "Llama-3.1-8B": dict(
        source="meta-llama/Llama-3.1-8B config.json (LlamaForCausalLM)",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        biases=False,  # attention_bias and mlp_bias false; RMSNorm has a weight only
        published_parameters=8_030_261_248,  # the safetensors index's total_size / 2 (bfloat16)
        projections="q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
    ),
}


def projections(c):
    """(in, out) of every attention and MLP projection of one layer (head_dim = hidden / heads in both models)."""
    h, f = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    if c["biases"]:  # GPT-NeoX: fused q/k/v, dense, and a two-matrix MLP
        return [(h, 3 * h), (h, h), (h, f), (f, h)]
    return [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]  # Llama: q, k, v, o, gate, up, down


def full_parameters(c):
    """Every parameter from the config: embeddings (and an untied output layer), the layers' linears, norms."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    linear = sum(i * o + (o if c["biases"] else 0) for i, o in projections(c))
    norm = 2 * h if c["biases"] else h  # LayerNorm: weight and bias; RMSNorm: weight
    embeddings = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    return embeddings + layers * (linear + 2 * norm) + norm


def calculate(rank: int, smol_config: dict):
    """LoRA's trained parameters r (in + out) per projection, the adapter in float32 (the learner's dtype, which
    PEFT saves) and bfloat16, and the full weights in float32 and bfloat16; SmolLM2 too, to check against the file."""
    out = {}
    for name, c in {**LARGE_MODELS, "SmolLM2-135M (measured above)": smol_config}.items():
        lora = c["num_hidden_layers"] * sum(rank * (i + o) for i, o in projections(c))
        params = full_parameters(c)
        out[name] = dict(
            config={k: v for k, v in c.items() if k not in ("source", "projections")},
            source=c.get("source"),
            projections=c.get("projections"),
            rank=rank,
            trained_parameters=lora,
            adapter_bytes_float32=4 * lora,
            adapter_bytes_bfloat16=2 * lora,
            parameters=params,
            full_bytes_float32=4 * params,
            full_bytes_bfloat16=2 * params,
        )
    return out


def smol_calc_config(path: str):
    """The measured model's own config.json, in the calculation's terms (a Llama: no biases)."""
    c = json.loads((Path(path) / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    return dict(
        {k: c[k] for k in keys},
        vocab_size=c["vocab_size"],
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        biases=False,
        source=f"{Path(path).name}/config.json",
        projections="q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        head_dim=c.get("head_dim"),
    )


# REPORT
def generation_lines(modes):
    """The generation timing's table (absent from results made before it was measured)."""
    if not all(m.get("generation") for m in modes.values()):
        return ["Generation with LoRA: not measured in this result (made before `lora_handoff.py` timed it).", ""]
    rate = {
        n: sum(g["seconds"] for g in m["generation"]) / sum(g["tokens"] for g in m["generation"])
        for n, m in modes.items()
    }
    one = next(iter(modes.values()))
    lines = [
        "## Generation through the adapter",
        "",
        f"The last version generates {one['generation'][0]['sequences']} sequences ({len(one['generation'])} timed "
        f"batches after an untimed one; {one['prompt_tokens']} prompt tokens a batch) with the script's own "
        "`generate`, the LoRA modes through the version's adapter. Seconds per 1,000 generated tokens over the "
        "timed batches (their lengths differ a little: each mode's policy samples its own):",
        "",
        "| mode | generated tokens (per batch) | s per batch | s / 1,000 tokens | this / full |",
        "|---|---|---|---|---|",
    ]
    for name, mode in modes.items():
        g = mode["generation"]
        lines.append(
            f"| {name} | {', '.join(str(x['tokens']) for x in g)} | "
            + ", ".join(f"{x['seconds']:.2f}" for x in g)
            + f" | {1000 * rate[name]:.2f} | "
            f"{rate[name] / rate['full']:.2f}x |"
        )
    lines += [
        "",
        "Why an adapter costs generation this much on CPU: vLLM's CPU backend applies adapters with the PyTorch-native "
        "punica ops (`PunicaWrapperCPU`, `vllm/lora/ops/torch_ops/lora_ops.py` in vLLM 0.32): `bgmv_shrink` and "
        "`bgmv_expand` gather each token's A and B matrices (`lora_b_weights[lora_indices_tensor]`) and multiply "
        "token by token (`einsum('bi, boi -> bo')`), so every token copies the whole adapter, rank x (in + out) "
        "values per projection, where one matrix product per projection would do; the ranks above show how that "
        "cost moves with the adapter's size. GPUs run vLLM's Triton punica kernels instead (not measured here).",
        "",
    ]
    return lines


def report(result, results_dir: Path):
    """lora_handoff.md from the measured and calculated result."""
    modes = result["modes"]
    full = modes["full"]
    kept = lambda mode, key: [r[key] for r in mode["rows"][1:]]  # the first version dropped: a warm-up
    med = lambda mode, key: statistics.median(kept(mode, key))
    least = lambda mode, key: min(kept(mode, key))
    spread = lambda mode, key: f"{med(mode, key):.3g} ({min(kept(mode, key)):.3g}-{max(kept(mode, key)):.3g})"
    mib = lambda b: f"{b / 2**20:.3g} MiB"
    gb = lambda b: f"{b / 1e9:.3g} GB ({b / 2**30:.3g} GiB)"
    measured = len(full["rows"]) - 1
    adapter_dirs = [str(m["adapter_dir"]) for name, m in modes.items() if name != "full"]
    where = "/dev/shm, a tmpfs" if all(d.startswith("/dev/shm") for d in adapter_dirs) else "a temporary folder"
    lines = [
        "# One policy version's hand-off to the engine: full weights against a LoRA adapter",
        "",
        f"{Path(result['policy']).name} ({full['parameters'] / 1e6:.1f}M parameters), float32 learner and float32 "
        f"CPU engine (vLLM), one torch thread; per mode {measured} policy versions after one warm-up version "
        "(dropped), each after one AdamW step of the learner on a fixed random batch of token ids "
        f"({result['batch_size']} x {result['batch_tokens']}). Each mode in its own process (one engine each).",
        f"Machine: {result['machine']}, {result['date']}; load average (1, 5, 15 min) "
        + ", ".join(f"{when} {' / '.join(f'{x:.1f}' for x in la)}" for when, la in result["load_average"].items())
        + "."
        + (f" {result['note']}" if result["note"] else ""),
        f"Produced by `{result['command']}`; the scripts as of commit {result['scripts_commit']}.",
        "",
        "Full weights: `async_dpo.py`'s hand-off; the learner copies its state dict to host memory and runs "
        "`weight_check` (probe logprobs, checksums of every tensor), the engine runs `push_weights_to_engine` "
        '(`collective_rpc("reload_weights")`) and `check_weight_sync`. Adapter: `async_dpo_lora.py`\'s; the learner '
        f"runs `save_adapter` (the adapter's safetensors in {where}, probe logprobs, checksums of the adapter's "
        "tensors), the engine runs `push_weights_to_engine` (`add_lora` of this version, `remove_lora` of the "
        "previous) and `check_weight_sync` (the file's tensors, the engine's adapter id, the probe through the "
        "adapter). Seconds: median (min-max) over the measured versions; full / this: the medians' ratio (and the "
        "minima's, which a burst of load on the shared cores moves less). Peak RSS: "
        "the whole process (learner, its AdamW state, engine, the copy handed over).",
        "",
        "| mode | trained parameters | bytes handed over | learner side s | engine: push s | engine: guard s | "
        "engine side s | hand-off s | full / this: hand-off (median; min) | full / this: engine side | "
        "full / this: push | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, mode in modes.items():
        size, last = mode["rows"][-1]["bytes"], full["rows"][-1]
        what = f"{last['tensors']} tensors" if name == "full" else f"{last['bytes'] / size:.3g}x less"
        lines.append(
            f"| {name} | {mode['trained_parameters'] / 1e6:.3g}M | {mib(size)} ({what}) | {spread(mode, 'learner')} | "
            f"{spread(mode, 'push')} | {spread(mode, 'guard')} | {spread(mode, 'engine')} | {spread(mode, 'total')} | "
            f"{med(full, 'total') / med(mode, 'total'):.3g}x; {least(full, 'total') / least(mode, 'total'):.3g}x | "
            f"{med(full, 'engine') / med(mode, 'engine'):.3g}x | "
            f"{med(full, 'push') / med(mode, 'push'):.3g}x | {mode['peak_rss_gib']:.2f} |"
        )
    r0 = full["rows"][-1]
    lines += [
        "",
        f"Full weights, learner side split: the host copy {spread(full, 'copy')} s, `weight_check` "
        f"{spread(full, 'weight_check')} s. The state dict holds {r0['tensors']} tensors, {mib(r0['bytes'])}; with "
        f"tied embeddings it names the embedding twice (`lm_head.weight`), so the copy carries "
        f"{mib(r0['bytes'] - r0['unique_bytes'])} more than the {mib(r0['unique_bytes'])} of distinct parameters. "
        "Adapter bytes: `adapter_model.safetensors` (float32, the learner's dtype); the folder with "
        "`adapter_config.json` is "
        + ", ".join(f"{name}: {mib(m['rows'][-1]['folder_bytes'])}" for name, m in modes.items() if name != "full")
        + ". The guard's share of the engine side (medians): "
        + ", ".join(f"{name} {med(m, 'guard') / med(m, 'engine'):.0%}" for name, m in modes.items())
        + ". Engine set-up (model load and engine build, not part of any hand-off): "
        + ", ".join(f"{name} {m['setup_seconds']:.0f} s" for name, m in modes.items())
        + ".",
        "",
        "`add_lora` reads the adapter file into the engine's adapter cache; the adapter enters the engine's LoRA "
        "slots with the first batch that names it, here the guard's probe, whose time includes that step (and the "
        "guard reads the file back for its checksums): the engine side, push + guard, is the figure to compare.",
        "",
        "Absolute times are noisy on this shared machine; compare the modes by their ratios within the run.",
        "",
        *generation_lines(modes),
        f"## By calculation: rank {result['calc_rank']} on every attention and MLP projection",
        "",
        "LoRA trains r (in + out) parameters per projection (A: r x in, B: out x r), summed over the layers; the "
        "adapter file is that many float32 values (PEFT saves the learner's dtype; bfloat16 halves it) plus a "
        "safetensors header (the tensors' names and shapes: tens of KB). The full-weight hand-off is every "
        "parameter (an untied output layer counted once). "
        "Config values as published in each model's config.json:",
        "",
        "| model | hidden | layers | intermediate | heads / kv heads | vocab | tied | projections (source) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    calc = result["calculated"]
    for name, c in calc.items():
        k = c["config"]
        lines.append(
            f"| {name} | {k['hidden_size']} | {k['num_hidden_layers']} | {k['intermediate_size']} | "
            f"{k['num_attention_heads']} / {k['num_key_value_heads']} | {k['vocab_size']} | "
            f"{'yes' if k['tie_word_embeddings'] else 'no'} | {c['projections']} ({c['source']}) |"
        )
    lines += [
        "",
        f"| model | trained parameters (rank {result['calc_rank']}) | adapter float32 | adapter bfloat16 | "
        "parameters (published) | full float32 | full bfloat16 | full / adapter (float32) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in calc.items():
        published = c["config"].get("published_parameters")
        lines.append(
            f"| {name} | {c['trained_parameters'] / 1e6:.4g}M ({c['trained_parameters'] / c['parameters']:.2%}) | "
            f"{mib(c['adapter_bytes_float32'])} | {mib(c['adapter_bytes_bfloat16'])} | "
            f"{c['parameters'] / 1e9:.4g}B" + (f" ({published / 1e9:.4g}B)" if published else "") + " | "
            f"{gb(c['full_bytes_float32'])} | {gb(c['full_bytes_bfloat16'])} | "
            f"{c['full_bytes_float32'] / c['adapter_bytes_float32']:.0f}x |"
        )
    smol = calc["SmolLM2-135M (measured above)"]
    rank_mode = modes.get(f"lora-{result['calc_rank']}")
    check = (
        f" The formula against the measured file at rank {result['calc_rank']}: {smol['adapter_bytes_float32']:,} "
        f"bytes calculated, {rank_mode['rows'][-1]['bytes']:,} in `adapter_model.safetensors` (the difference is its "
        f"header), {rank_mode['trained_parameters']:,} trained parameters counted by PEFT against "
        f"{smol['trained_parameters']:,} calculated."
        if rank_mode
        else ""
    )
    agree = [
        f"{name}: {c['parameters']:,} calculated, {c['config']['published_parameters']:,} published"
        for name, c in calc.items()
        if c["config"].get("published_parameters")
    ]
    lines += [
        "",
        "Parameters from these values against the published totals (Pythia: the Pythia paper's table; Llama-3.1-8B: "
        "its model.safetensors.index.json total_size / 2, bfloat16): " + "; ".join(agree) + "." + check + " "
        "`async_dpo_lora.py` "
        "refuses a GPT-NeoX base today (its LORA_MODULES knows the modules vLLM 0.32 applies adapters to for "
        "llama, mistral, qwen2, qwen3): the Pythia row is what the adapter would weigh, not a run the variant "
        "accepts.",
    ]
    text = "\n".join(lines) + "\n"
    (results_dir / "lora_handoff.md").write_text(text)
    return text


def main():
    args = tyro.cli(Args)
    if args.quick:
        args.versions = 2
        args.generate_prompts = 2
        args.generate_repeats = 1
    if args.versions < 2 or not args.ranks or min(args.ranks) < 1:
        sys.exit("error: --versions must be >= 2 (the first is a warm-up) and every --ranks value >= 1")
    if args.report_only:
        results_dir = Path(args.results_dir)
        print(report(json.loads((results_dir / "lora_handoff.json").read_text()), results_dir))
        return
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.mode:
        (work / f"{args.mode}.json").write_text(json.dumps(measure_mode(args), indent=1))
        return
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    commit = args.scripts_ref and subprocess.run(
        ["git", "rev-parse", "--verify", f"{args.scripts_ref}^{{commit}}"], cwd=REPO, capture_output=True, text=True
    )
    if commit and commit.returncode != 0:
        sys.exit(f"error: --scripts-ref {args.scripts_ref!r} is not a commit of {REPO}")
    commit = commit and commit.stdout.strip()
    modes, load_before = {}, os.getloadavg()
    for mode in ["full", *(f"lora-{r}" for r in args.ranks)]:
        print(f"measuring {mode} in its own process", flush=True)
        (work / f"{mode}.json").unlink(missing_ok=True)
        flags = [*sys.argv[1:], "--scripts-ref", commit, "--mode", mode]  # the last of a repeated flag counts
        proc = subprocess.run([sys.executable, __file__, *flags], env=env)
        if proc.returncode != 0:
            sys.exit(f"error: mode {mode} failed (exit {proc.returncode})")
        modes[mode] = json.loads((work / f"{mode}.json").read_text())
        if modes[mode]["scripts_commit"] != (commit or "working tree"):
            sys.exit(f"error: mode {mode} read the scripts at {modes[mode]['scripts_commit']}, not {commit}")
    result = dict(
        policy=policy_path(args),
        command=shlex.join(["python", "benchmark/lora_handoff.py", *sys.argv[1:]]),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        date=time.strftime("%Y-%m-%d %H:%M"),
        note=args.note,
        scripts_commit=commit or "working tree",
        load_average=dict(before=load_before, after=os.getloadavg()),
        batch_size=args.batch_size,
        batch_tokens=args.batch_tokens,
        calc_rank=args.calc_rank,
        modes=modes,
        calculated=calculate(args.calc_rank, smol_calc_config(policy_path(args))),
    )
    (results_dir / "lora_handoff.json").write_text(json.dumps(result, indent=1))
    print(report(result, results_dir))


if __name__ == "__main__":
    main()
