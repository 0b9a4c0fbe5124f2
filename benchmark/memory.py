"""Learner memory: what a run holds, measured on this CPU, and how close the default micro-batch's estimate is.

    python benchmark/memory.py                  # the measured runs (~30 min on 2 cores), then memory.md and memory.png
    python benchmark/memory.py --report-only    # rebuild memory.md / memory.png from the result files
    python benchmark/memory.py --quick --policy P --results-dir D --work-dir W   # the test suite's smoke run

Measured: async GRPO (`async_grpo_gsm8k.py`, no reward model, so the learner and the engine are all there is) on the
embedded SmolLM2-135M-Instruct and the generated arithmetic problems, for several prompts per step and micro-batch
sizes, each a real run of the script in a subprocess. The peak is the process's maximum resident set (`ru_maxrss`);
RSS is also sampled every 0.1 s and read at the moments the run reaches (models loaded, engine built), which splits
the peak into libraries, learner, engine and training. Each run also records the line in which the script states its
micro-batch and the estimate of that micro-batch's activations and logits (`choose_micro_batch_size`); the report
sets the peak against the sum of the parts and the estimate against the measured cost of one more sequence. What the
paper's configurations need on a GPU is computed in docs/benchmarks.md#gpu-memory-per-layout-computed.
"""

import json
import math
import os
import re
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

# (name, prompts per step, micro-batch size or None for the scripts' default, extra flags); 4 samples per prompt, so
# 8 prompts = 32 sequences. p4 is the peer setting of issue 31: 4 prompts x 4 samples x <= 32 tokens
SETTINGS = {
    "p2_m4": (2, 4, []),
    "p4_m4": (4, 4, []),
    "p8_m4": (8, 4, []),
    "p2_m32": (2, 32, []),
    "p4_m32": (4, 32, []),
    "p8_m32": (8, 32, []),
    "p4_m8": (4, 8, []),  # the micro-batch default before issue 31
    "p4_default": (4, None, []),
    "p8_default": (8, None, []),
    "p4_m8_checkpointing": (4, 8, ["--gradient-checkpointing"]),
    "p4_m8_bf16": (4, 8, ["--learner-dtype", "bfloat16"]),
    "p4_m8_mmap": (4, 8, []),  # run with MALLOC_MMAP_THRESHOLD_=65536 (see ENV_OF)
}
ENV_OF = {"p4_m8_mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
BREAKDOWN = ("p4_m8", "p4_default")  # the peer setting before and after the micro-batch default
CHOICE = re.compile(r"micro-batch (\d+) of (\d+) sequences \(est\. ([\d.]+) GiB")  # choose_micro_batch_size's line


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
    results_dir: str = str(REPO / "benchmark" / "results" / "memory")
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
    cmd = [
        sys.executable,
        str(REPO / "async_grpo_gsm8k.py"),
        "--model-name-or-path",
        args.policy,
        "--dataset-path",
        args.dataset_path,
        "--prompt-template",
        "{question}",
        "--response-length",
        str(args.response_length),
        "--max-prompt-tokens",
        "128",
        "--prompts-per-step",
        str(prompts),
        "--num-samples-per-prompt",
        "4",
        *(["--micro-batch-size", str(micro_batch_size)] if micro_batch_size else []),
        "--num-learner-steps",
        str(args.num_learner_steps),
        "--num-eval-prompts",
        "0",
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--learning-rate",
        "1e-6",
        "--seed",
        "1",
        "--output-dir",
        str(cwd / "model"),
        *extra,
    ]
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
            # tqdm's first bar ends with "\r", not "\n": the pipe hands it over with the next write, the bar after
            # learner step 0
            if "learner steps" in line and "step_0" not in marks:
                marks["step_0"] = now

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
    choice = next(m for m in map(CHOICE.search, lines) if m)  # the micro-batch the script ran, and its estimate
    command = [part.replace(str(REPO) + "/", "") for part in cmd]  # paths relative to the checkout
    result = dict(
        name=name,
        command=command,
        env=ENV_OF.get(name, {}),
        peak_rss_gib=peak,
        micro_batch_size=int(choice.group(1)),
        sequences_per_mini_batch=int(choice.group(2)),
        estimate_gib=float(choice.group(3)),
        rss_data_loaded_gib=rss_at("data_loaded"),
        rss_models_loaded_gib=rss_at("models_loaded"),
        rss_engine_built_gib=rss_at("engine_built"),
        rss_step_0_gib=rss_at("step_0"),
        training_s_per_step=sum(m["time/training"] for m in metrics) / len(metrics),
        parameters=count_parameters(args.policy),
        seconds=time.time() - start,
    )
    result_path.write_text(json.dumps(result, indent=1))
    shutil.rmtree(cwd, ignore_errors=True)


def count_parameters(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def breakdown(r: dict):
    """The parts of run `r` that must exist at its peak: (label, GiB, how it is known)."""
    copy = 4 * r["parameters"] / GIB  # one float32 copy of the policy
    kv = float(r["command"][r["command"].index("--kv-cache-gib") + 1])
    return [
        ("libraries, data (torch, transformers, vLLM)", r["rss_data_loaded_gib"] or 0.0, "RSS before the first model"),
        ("learner: weights, gradients, AdamW (16 B/param)", 4 * copy, "computed"),
        ("frozen reference", 0.0, "not loaded: GRPO's default `--kl-coef 0`"),
        ("engine weights (float32)", copy, "computed"),
        ("KV cache", kv, "`--kv-cache-gib`"),
        ("one weight copy in flight to the engine", copy, "computed"),
        ("one micro-batch's activations and logits", r["estimate_gib"], "the script's estimate, as it printed it"),
    ]


def cells(values):
    return " | ".join("-" if v is None else f"{v:.2f}" for v in values)


def report(results_dir: Path):
    results = {}
    for name in SETTINGS:
        path = results_dir / "runs" / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    lines = [
        "Measured on this CPU by `python benchmark/memory.py`: async GRPO (`async_grpo_gsm8k.py`) on "
        "SmolLM2-135M-Instruct, 4 samples per",
        "prompt, responses of at most 32 tokens, KV cache 1 GiB, 2 learner steps per run, one torch thread. Peak = "
        "maximum resident set",
        "of the process. Micro-batch and estimate as the script printed them; `default`: no `--micro-batch-size`, so "
        "the budget",
        "`--micro-batch-memory-gib 4` decides.",
        "",
        "| setting | prompts/step | sequences/step | micro-batch | peak RSS (GiB) | est. one micro-batch (GiB) "
        "| training s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        prompts, micro, _ = SETTINGS[name]
        chosen = r.get("micro_batch_size", micro)
        lines.append(
            f"| {name} | {prompts} | {4 * prompts} | {chosen}{'' if micro else ' (default)'} | "
            f"{r['peak_rss_gib']:.2f} | {cells([r.get('estimate_gib')])} | {r['training_s_per_step']:.1f} |"
        )
    bases = [results[n] for n in BREAKDOWN if n in results] or list(results.values())[:1]
    bases = [b for b in bases if "estimate_gib" in b]  # result files from before the estimate have no breakdown
    if bases:
        first, names = bases[0], " and ".join("`" + b["name"] + "`" for b in bases)
        parts = [breakdown(b) for b in bases]
        sums = [sum(gib for _, gib, _ in part) for part in parts]
        learner = [sum(part[i][1] for i in (1, 2, 6)) for part in parts]  # the learner's own parts
        shares = [b["peak_rss_gib"] - (s - p) for b, s, p in zip(bases, sums, learner)]
        lines += [
            "",
            f"The parts of {names} ({first['parameters'] / 1e6:.1f}M parameters, "
            f"{4 * first['parameters'] / GIB:.2f} GiB per float32 copy) against the measured peak:",
            "",
            "| part | " + " | ".join(b["name"] + " (GiB)" for b in bases) + " | how it is known |",
            "|---|" + "---|" * len(bases) + "---|",
        ]
        for i, (label, _, how) in enumerate(parts[0]):
            lines.append(f"| {label} | {cells(part[i][1] for part in parts)} | {how} |")
        lines += [
            f"| **sum of the parts** | {cells(sums)} | |",
            f"| measured: after the models load | {cells(b['rss_models_loaded_gib'] for b in bases)} | RSS |",
            f"| measured: after the engine is built | {cells(b['rss_engine_built_gib'] for b in bases)} | RSS |",
            f"| measured: after learner step 0 | {cells(b.get('rss_step_0_gib') for b in bases)} | RSS |",
            f"| **measured peak** | {cells(b['peak_rss_gib'] for b in bases)} | `ru_maxrss` |",
            f"| peak / sum (goal <= 1.2) | {cells(b['peak_rss_gib'] / s for b, s in zip(bases, sums))} | |",
            f"| the learner's parts: weights, gradients, AdamW, reference, estimate | {cells(learner)} "
            "| rows 2, 3, 7 |",
            f"| the learner's share of the peak | {cells(shares)} | peak - rows 1, 4, 5, 6 |",
            f"| learner share / learner parts (goal <= 1.2) | {cells(s / p for s, p in zip(shares, learner))} | |",
            "",
            f"Command of `{first['name']}` (the other settings change `--prompts-per-step` and `--micro-batch-size`):",
            "",
            "    " + " ".join(["python", *first["command"][1:]]),
        ]
    # the estimate against the measured cost of one more sequence: runs whose one micro-batch is the whole mini-batch
    whole = {}  # sequences -> the first such run without extra flags
    for name, r in results.items():
        if (
            re.fullmatch(r"p\d+_(m\d+|default)", name)
            and "estimate_gib" in r
            and r["micro_batch_size"] >= r["sequences_per_mini_batch"]
        ):
            whole.setdefault(r["sequences_per_mini_batch"], r)
    whole = [whole[n] for n in sorted(whole)]
    if len(whole) >= 2:
        lines += [
            "",
            "The estimate per sequence against the measured cost of one more sequence (runs whose one "
            "micro-batch holds the whole mini-batch):",
            "",
            "| runs | sequences | measured GiB per extra sequence | estimated GiB per sequence | estimate / measured |",
            "|---|---|---|---|---|",
        ]
        for a, b in zip(whole, whole[1:]):
            na, nb = a["sequences_per_mini_batch"], b["sequences_per_mini_batch"]
            measured, estimated = (b["peak_rss_gib"] - a["peak_rss_gib"]) / (nb - na), b["estimate_gib"] / nb
            lines.append(
                f"| {a['name']} -> {b['name']} | {na} -> {nb} | {measured:.3f} | {estimated:.3f} | "
                f"{estimated / measured:.2f} |"
            )
    lines += [
        "",
        "What the paper's configurations need on a GPU is computed, not measured, in docs/benchmarks.md "
        "(GPU memory per layout).",
    ]
    (results_dir / "memory.md").write_text("\n".join(lines) + "\n")
    grid = [
        (
            SETTINGS[n][0] * 4,
            r.get("micro_batch_size", SETTINGS[n][1]) if SETTINGS[n][1] else "default",
            r["peak_rss_gib"],
        )
        for n, r in results.items()
        if re.fullmatch(r"p\d+_(m\d+|default)", n)
    ]
    if grid:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.4))
        for micro in sorted({m for _, m, _ in grid}, key=lambda m: (m == "default", 0 if m == "default" else m)):
            points = sorted((s, p) for s, m, p in grid if m == micro)
            label = "default micro-batch" if micro == "default" else f"micro-batch {micro}"
            ax.plot([s for s, _ in points], [p for _, p in points], "o-", label=label)
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
    (results_dir / "runs").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        args.policy = args.policy or str(REPO / "models" / "SmolLM2-135M-Instruct")
        for flag, path in (
            ("--policy", Path(args.policy) / "config.json"),
            ("--dataset-path", Path(args.dataset_path) / "train.jsonl"),
        ):
            if not path.exists():
                sys.exit(f"error: {flag}: no {path}; run `bash install.sh` first")
        for name in args.settings:
            path = results_dir / "runs" / f"{name}.json"
            if path.exists() and not args.force:
                print(f"== {name}: done already ({path})")
                continue
            run_one(args, name, path)
    print("\n".join(report(results_dir)))
