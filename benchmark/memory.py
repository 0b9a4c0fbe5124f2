"""Learner memory: what a run holds, measured on this CPU, and what the paper's configurations need on a GPU.

    python benchmark/memory.py                  # the measured runs (~25 min on 2 cores), then memory.md and memory.png
    python benchmark/memory.py --report-only    # rebuild memory.md / memory.png from the result files
    python benchmark/memory.py --quick --policy P --results-dir D --work-dir W   # the test suite's smoke run

Measured: async GRPO (`async_grpo_gsm8k.py`, no reward model, so the learner and the engine are all there is) on the
embedded SmolLM2-135M-Instruct and the generated arithmetic problems, for several prompts per step and micro-batch
sizes, each a real run of the script in a subprocess. The peak is the process's maximum resident set (`ru_maxrss`);
RSS is also sampled every 0.1 s and read at the moments the run reaches (models loaded, engine built), which splits
the peak into libraries, learner, engine and training. On a GPU the same split reads `torch.cuda.max_memory_allocated`;
this machine has none.

Computed (not measured): for the paper's configurations, the learner's bytes on a GPU (weights, gradients, AdamW,
reference/reward/value models, one micro-batch's activations and logits) and the largest micro-batch that fits a 24,
40 or 80 GB card, alone or beside a vLLM engine that takes 30% of it.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import tyro

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30

# (name, prompts per step, micro-batch size, extra flags); 4 samples per prompt, so 8 prompts = 32 sequences
SETTINGS = {
    "p2_m4": (2, 4, []), "p4_m4": (4, 4, []), "p8_m4": (8, 4, []),
    "p2_m32": (2, 32, []), "p4_m32": (4, 32, []), "p8_m32": (8, 32, []),
    "p4_m8": (4, 8, []),
    "p4_m8_checkpointing": (4, 8, ["--gradient-checkpointing"]),
    "p4_m8_bf16": (4, 8, ["--learner-dtype", "bfloat16"]),
    "p4_m8_mmap": (4, 8, []),  # run with MALLOC_MMAP_THRESHOLD_=65536 (see ENV_OF)
}
ENV_OF = {"p4_m8_mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


@dataclass
class Args:
    settings: List[str] = field(default_factory=lambda: list(SETTINGS))
    """settings to run (names of SETTINGS)"""
    policy: Optional[str] = None
    """policy model folder; None: models/SmolLM2-135M-Instruct (made by install.sh)"""
    dataset_path: str = str(REPO / "data" / "arithmetic")
    """GSM8K-format problems (made by install.sh)"""
    response_length: int = 32
    """maximum new tokens per response"""
    num_learner_steps: int = 2
    """learner steps per run (the peak is reached in the first steps: nothing accumulates)"""
    kv_cache_gib: float = 1.0
    """the engine's KV cache (the scripts' CPU default)"""
    results_dir: str = str(REPO / "benchmark" / "results")
    """where result files, memory.md and memory.png go"""
    work_dir: str = str(REPO / "benchmark" / "work" / "memory")
    """scratch space (git-ignored): run folders"""
    quick: bool = False
    """smoke mode for the test suite: settings p2_m4 and p2_m32, 1 learner step, 8-token responses"""
    force: bool = False
    """rerun runs whose result file exists"""
    report_only: bool = False
    """only rebuild memory.md and memory.png from existing result files"""


def rss_gib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024 / GIB


def run_one(args: Args, name: str, result_path: Path):
    """One run of the script; the peak RSS from the kernel, and RSS at the moments the run's output marks."""
    prompts, micro_batch_size, extra = SETTINGS[name]
    cwd = Path(args.work_dir) / name
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / "async_grpo_gsm8k.py"), "--model-name-or-path", args.policy,
           "--dataset-path", args.dataset_path, "--prompt-template", "{question}",
           "--response-length", str(args.response_length), "--max-prompt-tokens", "128",
           "--prompts-per-step", str(prompts), "--num-samples-per-prompt", "4", "--micro-batch-size",
           str(micro_batch_size), "--num-learner-steps", str(args.num_learner_steps), "--num-eval-prompts", "0",
           "--kv-cache-gib", str(args.kv_cache_gib), "--learning-rate", "1e-6", "--seed", "1",
           "--output-dir", str(cwd / "model"), *extra]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false", **ENV_OF.get(name, {})}
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks, samples, lines = {}, [], []

    def read_output():  # the moments of a run, from its own output
        for line in proc.stdout:
            lines.append(line)
            now = time.time() - start
            if "Loading weights" in line and "data_loaded" not in marks:
                marks["data_loaded"] = now
            if "non-default args" in line and "models_loaded" not in marks:
                marks["models_loaded"] = now
            if "init engine" in line:
                marks["engine_built"] = now

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    while True:  # wait4 rather than poll: it returns this child's own resource usage, its peak RSS among them
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            samples.append((time.time() - start, rss_gib(proc.pid)))
        except (OSError, StopIteration):
            pass
        time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=10)
    if proc.returncode != 0:
        sys.exit(f"error: {name} failed (exit {proc.returncode}):\n{''.join(lines[-40:])}")
    peak = usage.ru_maxrss * 1024 / GIB  # Linux reports KiB

    def rss_at(moment):  # the last sample before the output line that marks the moment
        return max((rss for t, rss in samples if t <= marks[moment]), default=0.0) if moment in marks else None

    metrics = [json.loads(line) for line in next((cwd / "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
    command = [part.replace(str(REPO) + "/", "") for part in cmd]  # paths relative to the checkout
    result = dict(name=name, command=command, env=ENV_OF.get(name, {}), peak_rss_gib=peak,
                  rss_data_loaded_gib=rss_at("data_loaded"), rss_models_loaded_gib=rss_at("models_loaded"),
                  rss_engine_built_gib=rss_at("engine_built"),
                  training_s_per_step=sum(m["time/training"] for m in metrics) / len(metrics),
                  parameters=count_parameters(args.policy), seconds=time.time() - start)
    result_path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)


def count_parameters(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


# GPU CALCULATION: bytes of the learner for the paper's configurations (a calculation, not a measurement)
# name -> (parameters, layers, hidden, vocabulary, attention heads)
MODELS = {
    "Pythia-410m": (405e6, 24, 1024, 50304, 16),
    "Pythia-1b": (1.01e9, 16, 2048, 50304, 8),
    "Pythia-2.8b": (2.78e9, 32, 2560, 50304, 32),
    "Rho-1B": (1.10e9, 22, 2048, 32000, 32),
}
# name -> (script, policy, reward/value model, sequence length, response length)
CONFIGS = [
    ("dpo / rloo, TL;DR", "Pythia-410m", "Pythia-410m", 565, 53),
    ("ppo, TL;DR", "Pythia-410m", "Pythia-410m", 565, 53),
    ("dpo / rloo, TL;DR", "Pythia-1b", "Pythia-1b", 565, 53),
    ("ppo, TL;DR", "Pythia-1b", "Pythia-1b", 565, 53),
    ("dpo / rloo, TL;DR", "Pythia-2.8b", "Pythia-2.8b", 565, 53),
    ("grpo, GSM8K", "Rho-1B", None, 1024, 512),
]


def learner_bytes(config, micro_batch_size: int, checkpointing: bool):
    """Learner bytes on its GPU: float32 weights, gradients and AdamW (16 B per trained parameter), the frozen
    reference (4 B), PPO's value model (trained, 16 B), one micro-batch's activations (Korthikanti et al., 2022:
    34 * s * b * h bytes per layer in 16-bit with fused attention, doubled for float32; with checkpointing the layer
    inputs plus one layer) and its logits over the response positions (float32, twice: logits / T and logsumexp)."""
    algo, policy, critic, seq, response = config
    p, layers, hidden, vocab, _ = MODELS[policy]
    state = 16 * p + (4 * p if not algo.startswith("grpo") else 0)
    if algo.startswith("ppo"):
        state += 16 * MODELS[critic][0]
    per_layer = 68 * seq * micro_batch_size * hidden
    activations = (4 * seq * micro_batch_size * hidden * layers + per_layer) if checkpointing else per_layer * layers
    logits = 2 * 4 * micro_batch_size * response * vocab
    if algo.startswith("ppo"):  # the value model's forward keeps its activations too
        activations *= 2
    return state, activations + logits


def gpu_table():
    rows = []
    for config in CONFIGS:
        algo, policy, critic, seq, response = config
        cells = []
        for checkpointing in (False, True):
            for card in (24, 40, 80):
                for share in (1.0, 0.7):  # alone, or beside an engine holding 30% of the card
                    fits = [m for m in (1, 2, 4, 8, 16, 32, 64)
                            if sum(learner_bytes(config, m, checkpointing)) <= 0.9 * share * card * 1e9]
                    cells.append(str(max(fits)) if fits else "-")
        state, _ = learner_bytes(config, 1, False)
        rows.append(f"| {algo} | {policy} | {seq} / {response} | {state / 1e9:.1f} | " + " | ".join(cells) + " |")
    header = ("| script, task | policy | tokens (all / response) | weights + grads + AdamW + frozen models (GB) | " +
              " | ".join(f"{'ckpt ' if c else ''}{card} GB{' shared' if share < 1 else ''}"
                         for c in (False, True) for card in (24, 40, 80) for share in (1.0, 0.7)) + " |\n|" +
              "---|" * 16)
    return header + "\n" + "\n".join(rows)


def report(results_dir: Path):
    results = {}
    for name in SETTINGS:
        path = results_dir / "memory" / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    lines = ["Measured on this CPU by `python benchmark/memory.py`: async GRPO on SmolLM2-135M-Instruct, 4 samples "
             "per prompt,", "responses of at most 32 tokens, KV cache 1 GiB, 2 learner steps per run. Peak = "
             "maximum resident set of the process.", "",
             "| setting | prompts/step | sequences/step | micro-batch | peak RSS (GiB) | training s/step |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        prompts, micro, _ = SETTINGS[name]
        lines.append(f"| {name} | {prompts} | {4 * prompts} | {micro} | {r['peak_rss_gib']:.2f} | "
                     f"{r['training_s_per_step']:.1f} |")
    base = results.get("p4_m8") or (next(iter(results.values())) if results else None)
    if base:
        gib_per_copy = 4 * base["parameters"] / GIB
        kv = float(base["command"][base["command"].index("--kv-cache-gib") + 1])
        libraries = base["rss_data_loaded_gib"] or 0.0
        must = dict(libraries=libraries, learner=4 * gib_per_copy, engine_weights=gib_per_copy, kv_cache=kv,
                    weight_copy=gib_per_copy)
        lines += ["", f"Breakdown of `{base['name']}` ({base['parameters'] / 1e6:.1f}M parameters, "
                  f"{gib_per_copy:.2f} GiB per float32 copy):", "",
                  "| part | GiB | how it is known |", "|---|---|---|",
                  f"| libraries, data (torch, transformers, vLLM) | {libraries:.2f} | RSS before the first model |",
                  f"| learner: weights, gradients, AdamW (16 B/param) | {must['learner']:.2f} | computed |",
                  f"| engine weights (float32) | {gib_per_copy:.2f} | computed |",
                  f"| KV cache | {kv:.2f} | `--kv-cache-gib` |",
                  f"| one weight copy in flight to the engine | {gib_per_copy:.2f} | computed |",
                  f"| **sum of the parts that must exist** | **{sum(must.values()):.2f}** | |",
                  f"| measured: after the models load | {base['rss_models_loaded_gib']:.2f} | RSS |",
                  f"| measured: after the engine is built | {base['rss_engine_built_gib']:.2f} | RSS |",
                  f"| **measured peak** | **{base['peak_rss_gib']:.2f}** | `ru_maxrss` |",
                  f"| everything else (activations, logits, allocator, engine buffers) | "
                  f"{base['peak_rss_gib'] - sum(must.values()):.2f} | peak - sum |",
                  f"| peak / sum (target <= 1.3) | {base['peak_rss_gib'] / sum(must.values()):.2f} | |"]
    lines += ["", "Computed, not measured: the largest micro-batch (`--micro-batch-size`, sequences) whose learner "
              "fits in 90% of a GPU, alone or", "beside a vLLM engine that takes 30% of the card (one shared GPU); "
              "'ckpt' with `--gradient-checkpointing`. See `learner_bytes`.", "", gpu_table()]
    (results_dir / "memory.md").write_text("\n".join(lines) + "\n")
    grid = [(SETTINGS[n][0] * 4, SETTINGS[n][1], r["peak_rss_gib"]) for n, r in results.items() if n[-1].isdigit()]
    if grid:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.4))
        for micro in sorted({m for _, m, _ in grid}):
            points = sorted((s, p) for s, m, p in grid if m == micro)
            ax.plot([s for s, _ in points], [p for _, p in points], "o-", label=f"micro-batch {micro}")
        ax.set_xlabel("sequences per learner step")
        ax.set_ylabel("peak RSS (GiB)")
        ax.set_title("async GRPO, SmolLM2-135M, CPU")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(results_dir / "memory.png", dpi=120)
    return lines


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        defaults = Args()
        if args.settings == defaults.settings:
            args.settings = ["p2_m4", "p2_m32"]
        args.num_learner_steps = 1 if args.num_learner_steps == defaults.num_learner_steps else args.num_learner_steps
        args.response_length = 8 if args.response_length == defaults.response_length else args.response_length
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        sys.exit(f"error: unknown --settings {unknown}; known: {list(SETTINGS)}")
    results_dir = Path(args.results_dir)
    (results_dir / "memory").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        args.policy = args.policy or str(REPO / "models" / "SmolLM2-135M-Instruct")
        for flag, path in (("--policy", Path(args.policy) / "config.json"),
                           ("--dataset-path", Path(args.dataset_path) / "train.jsonl")):
            if not path.exists():
                sys.exit(f"error: {flag}: no {path}; run `bash install.sh` first")
        for name in args.settings:
            path = results_dir / "memory" / f"{name}.json"
            if path.exists() and not args.force:
                print(f"== {name}: done already ({path})")
                continue
            run_one(args, name, path)
    print("\n".join(report(results_dir)))
