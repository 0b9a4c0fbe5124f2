"""In-flight weight updates against the core at K = 1 (issue 45): seconds per learner step, the engine's idle share,
how stale the tokens are, and held-out accuracy after a fixed number of steps, over seeds.

SmolLM2-135M-Instruct (made by install.sh) on GSM8K's problems in its chat template: with --response-length 192 a
third or more of the responses run to the limit while others end early, the long tail in-flight updates are for.
One learner step trains one problem's G = 4 samples, which balances generation and training on this 2-core machine
(docs/benchmarks.md, the speed table's grpo_p1 row). Every setting runs `--off-policy-correction decoupled`, so
that the settings differ in when weights reach the engine and nothing else.

    python benchmark/inflight.py                  # 3 settings x 3 seeds; resumable: finished runs are kept
    python benchmark/inflight.py --report-only    # rebuild benchmark/results/inflight/inflight.md and inflight.png
    python benchmark/inflight.py --kv-gap         # what `--in-flight-kv keep` costs in logprob: inflight_kv.md
"""

import json
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import tyro

import common

REPO = common.REPO
CORE, INFLIGHT = "async_grpo_gsm8k.py", "async_grpo_gsm8k_inflight.py"
# setting: (script, flags); all at K = 1, the paper's async setting
SETTINGS = {
    "core": (CORE, []),
    "fixed": (INFLIGHT, ["--in-flight", "fixed"]),  # --in-flight-chunk from Args.chunk
    "asap": (INFLIGHT, ["--in-flight", "asap"]),
}


@dataclass
class Args:
    settings: Tuple[str, ...] = tuple(SETTINGS)
    """which settings to run"""
    seeds: Tuple[int, ...] = (1, 2, 3)
    """seeds per setting"""
    num_learner_steps: int = 10
    """learner steps per run (evaluated at version 0 and at the end)"""
    warmup_steps: int = 2
    """steps left out of the s/step median (engine and learner warm-up)"""
    response_length: int = 192
    """maximum new tokens: long enough that a third or more of the responses are cut"""
    chunk: int = 96
    """fixed: the next version enters after this many decoding steps (half the response length)"""
    learning_rate: float = 1e-6
    """the speed table's"""
    num_eval_prompts: int = 32
    """held-out GSM8K test problems, greedy"""
    policy: str = str(REPO / "models" / "SmolLM2-135M-Instruct")
    """made by install.sh"""
    dataset_path: str = str(REPO / "data" / "gsm8k")
    """made by install.sh (tools/prepare_gsm8k.py)"""
    chat_template: bool = True
    """the filled --prompt-template as the user message of the policy's chat template"""
    prompt_template: str = "{question}"
    """the problem alone (the scripts' --prompt-template)"""
    prompts_per_step: int = 1
    """problems per learner step, each with 4 samples"""
    max_prompt_tokens: Optional[int] = None
    """None: the script's default (512); a small policy may have fewer positions"""
    results_dir: str = str(REPO / "benchmark" / "results" / "inflight")
    work_dir: str = str(REPO / "benchmark" / "work" / "inflight")
    report_only: bool = False
    """only rebuild inflight.md and inflight.png from the result files"""
    kv_gap: bool = False
    """only measure the logprob gap of kept vs recomputed KV after a swap (inflight_kv.md)"""
    kv_swap_step: int = 32
    """--kv-gap: the new version enters after this many decoding steps"""


def command(args: Args, setting: str, seed: int, output_dir: Path):
    script, flags = SETTINGS[setting]
    flags = [*flags, "--in-flight-chunk", str(args.chunk)] if setting == "fixed" else flags
    return [
        sys.executable,
        str(REPO / script),
        "--model-name-or-path",
        os.path.abspath(args.policy),
        "--dataset-path",
        os.path.abspath(args.dataset_path),
        *["--chat-template"] * args.chat_template,
        "--prompt-template",
        args.prompt_template,
        "--prompts-per-step",
        str(args.prompts_per_step),
        "--num-samples-per-prompt",
        "4",
        "--response-length",
        str(args.response_length),
        "--learning-rate",
        str(args.learning_rate),
        "--num-learner-steps",
        str(args.num_learner_steps),
        "--async-steps",
        "1",
        "--off-policy-correction",
        "decoupled",
        "--num-eval-prompts",
        str(args.num_eval_prompts),
        "--eval-every",
        str(args.num_learner_steps),
        "--sample-every",
        "1000",
        "--seed",
        str(seed),
        "--output-dir",
        str(output_dir),
        *flags,
        *(["--max-prompt-tokens", str(args.max_prompt_tokens)] if args.max_prompt_tokens else []),
    ]


def without_output_dir(cmd):
    i = cmd.index("--output-dir")
    return cmd[:i] + cmd[i + 2 :]


def run(args: Args, setting: str, seed: int, path: Path):
    cwd = Path(args.work_dir) / path.stem
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    cmd = command(args, setting, seed, cwd / "model")
    print(f"== {path.stem}: {' '.join(cmd)}", flush=True)
    start = time.time()
    common.run_script(cmd, cwd, path.stem)
    (run_folder,) = list((cwd / "runs").iterdir())
    read = lambda name: [json.loads(line) for line in (run_folder / name).read_text().splitlines()]
    path.write_text(
        json.dumps(
            dict(
                setting=setting,
                seed=seed,
                command=cmd[1:],
                warmup_steps=args.warmup_steps,
                benchmark_flags=sys.argv[1:],
                process_seconds=time.time() - start,
                date=time.strftime("%Y-%m-%d %H:%M"),
                machine=f"{platform.machine()}, {os.cpu_count()} cores",
                metrics=read("metrics.jsonl"),
                evaluations=read("eval.jsonl"),
            ),
            indent=1,
        )
    )
    shutil.rmtree(cwd, ignore_errors=True)  # the saved model is not needed


def summarize(result):
    """One run's numbers: s/step is the median of the timed steps' wall times (after the warm-up)."""
    metrics, timed = result["metrics"], result["metrics"][result["warmup_steps"] :]
    elapsed = [m["time/elapsed"] for m in metrics]
    step = float(np.median(np.diff(elapsed[result["warmup_steps"] - 1 :])))
    mean = lambda key: float(np.mean([m[key] for m in timed]))
    evals = {e["policy_version"]: e["eval/accuracy"] for e in result["evaluations"]}
    return {
        "s/step": step,
        "engine idle share": mean("time/actor_waiting") / step,
        "learner idle share": mean("time/learner_waiting") / step,
        "weight sync share": mean("time/weight_sync") / step,
        "token staleness": float(
            np.mean([m.get("async/token_staleness_mean", m["async/staleness"]) for m in metrics[1:]])
        ),
        "mixed-version sequences": float(np.mean([m.get("async/mixed_version_share", 0.0) for m in metrics[1:]])),
        "truncated": mean("val/truncated_rate"),
        "response length": mean("val/response_length"),
        "accuracy at 0": evals[0],
        "final accuracy": evals[max(evals)],
    }


def report(args: Args):
    folder = Path(args.results_dir)
    results = [json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*.json"))]
    if not results:
        sys.exit(f"error: no result files in {folder / 'inflight'}; run without --report-only first")
    runs = {(r["setting"], r["seed"]): summarize(r) for r in results}
    keys, cmd = list(next(iter(runs.values()))), results[0]["command"]
    flag = lambda name: cmd[cmd.index(name) + 1]
    setup = (
        f"{Path(flag('--model-name-or-path')).name} on {Path(flag('--dataset-path')).name}"
        f"{' in its chat template' if '--chat-template' in cmd else ''}, {flag('--prompts-per-step')} problem(s) "
        f"x 4 samples per step, responses of at most {flag('--response-length')} tokens"
    )
    lines = [
        "In-flight weight updates vs the core at K = 1 (issue 45). Produced by `python benchmark/inflight.py"
        f"{shlex.join(['', *results[-1].get('benchmark_flags', [])])[2:]}`: {setup}, {flag('--num-learner-steps')} learner steps at learning rate "
        f"{flag('--learning-rate')}, K = 1, decoupled correction, one torch thread per role. Mean ± std over "
        "seeds; s/step is each run's median after the warm-up; 'vs core' pairs each run with the core run of its "
        "seed; the shares are of s/step.",
        "",
        "| setting | seeds | " + " | ".join(keys) + " | s/step vs core |",
        "|---" * (len(keys) + 3) + "|",
    ]
    for setting in SETTINGS:
        seeds = sorted(seed for s, seed in runs if s == setting)
        if not seeds:
            continue
        cells = [
            f"{np.mean(v):.3f} ± {np.std(v, ddof=1) if len(v) > 1 else 0:.3f}"
            for v in ([runs[setting, seed][key] for seed in seeds] for key in keys)
        ]
        paired = [
            runs[setting, seed]["s/step"] / runs["core", seed]["s/step"] for seed in seeds if ("core", seed) in runs
        ]
        ratio = f"{np.mean(paired):.3f} [{min(paired):.3f}-{max(paired):.3f}]" if paired else ""
        lines.append(f"| {setting} | {len(seeds)} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "Per run:", "", "| setting | seed | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    lines += [
        f"| {s} | {seed} | " + " | ".join(f"{v[key]:.3f}" for key in keys) + " |"
        for (s, seed), v in sorted(runs.items())
    ]
    (folder / "inflight.md").write_text("\n".join(lines) + "\n")
    plot(runs, folder / "inflight.png", setup)
    print("\n".join(lines))


def plot(runs, path: Path, setup: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in SETTINGS if any(k[0] == s for k in runs)]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key in zip(axes, ("s/step", "token staleness", "final accuracy")):
        for i, setting in enumerate(settings):
            values = [v[key] for (s, _), v in runs.items() if s == setting]
            ax.bar(i, np.mean(values), color="lightgray", edgecolor="black")
            ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(settings)), settings)
        ax.set_title(key)
    fig.suptitle(f"In-flight weight updates vs the core, K = 1: {setup}; 2-core CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def kv_gap(args: Args):
    """One batch of --kv-gap's 4 problems x 4 samples on the real engine, version 1 (one AdamW step at
    --learning-rate on the batch's own samples, the size of one learner step) loaded after --kv-swap-step decoding
    steps: the mean |logprob - version 1's| of the tokens after the swap, with the KV kept and recomputed, beside the
    gap one version of staleness makes on the same tokens (|version 0's - version 1's|)."""
    import torch
    from transformers import AutoModelForCausalLM

    script = common.load_script(INFLIGHT)
    flags = script.RunArgs(
        model_name_or_path=args.policy,
        dataset_path=args.dataset_path,
        num_samples_per_prompt=4,
        response_length=args.response_length,
        engine_device="cpu",
        learner_device="cpu",
        chat_template=args.chat_template,
        prompt_template=args.prompt_template,
        **({"max_prompt_tokens": args.max_prompt_tokens} if args.max_prompt_tokens else {}),
    )
    tokenizer, flags.eos_token_ids = script.load_tokenizer(flags)
    prompts = script.load_problem_sets(flags, tokenizer)[0][:4]
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
    llm = script.build_engine(flags)
    script.keep_models_eager(model)
    versions = [{name: t.detach().clone() for name, t in model.state_dict().items()}]

    def learner_logprobs(version, prompt, response):
        model.load_state_dict(versions[version])
        ids = torch.tensor([prompt + response])
        mask = torch.tensor([[0] * len(prompt) + [1] * len(response)])
        with torch.no_grad():
            return script.token_logprobs(model, ids, torch.ones_like(ids), mask, flags.temperature)[
                0, len(prompt) - 1 :
            ]

    tokens = script.generate(llm, prompts, flags, 0, lambda steps: 0)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, eps=1e-5)
    for i, response in enumerate(tokens):  # one update on the negative log-likelihood of the batch
        ids = torch.tensor([prompts[i // 4] + response])
        mask = torch.tensor([[0] * len(prompts[i // 4]) + [1] * len(response)])
        (-script.token_logprobs(model, ids, torch.ones_like(ids), mask, 1.0).sum() / len(tokens)).backward()
    optimizer.step()
    versions.append({name: t.detach().clone() for name, t in model.state_dict().items()})
    result = dict(policy=args.policy, swap_after_decoding_steps=args.kv_swap_step, learning_rate=args.learning_rate)
    for kv in ("keep", "recompute"):
        script.push_weights_to_engine(llm, versions[0])

        def swap(steps, kv=kv):
            if steps == args.kv_swap_step:
                script.push_weights_to_engine(llm, versions[1], kv)
            return int(steps >= args.kv_swap_step)

        start = time.time()
        tokens, logprobs, made_by = script.generate(llm, prompts, flags, 0, swap)
        gaps, staleness = [], []
        for i, (response, lp, v) in enumerate(zip(tokens, logprobs, made_by)):
            after = [j for j, version in enumerate(v) if version == 1]
            if after:
                new, old = (learner_logprobs(version, prompts[i // 4], response)[after] for version in (1, 0))
                gaps += (torch.tensor(lp)[after] - new).abs().tolist()
                staleness += (old - new).abs().tolist()
        result[kv] = dict(
            tokens_after_swap=len(gaps),
            mean_gap=float(np.mean(gaps)),
            max_gap=float(np.max(gaps)),
            one_version_of_staleness=float(np.mean(staleness)),
            generation_seconds=time.time() - start,
        )
    path = Path(args.results_dir) / "inflight_kv.json"
    path.parent.mkdir(parents=True, exist_ok=True)  # a new --results-dir
    path.write_text(json.dumps(result, indent=1))
    lines = [
        f"The logprob gap `--in-flight-kv keep` causes (issue 45). Produced by `python benchmark/inflight.py "
        f"--kv-gap`: {Path(args.policy).name}, 4 GSM8K problems x 4 samples, version 1 = one AdamW step at "
        f"{args.learning_rate:g} on the batch's samples, loaded after {args.kv_swap_step} decoding steps. Per "
        "token after the swap: |recorded logprob - version 1's| (the learner's, float32), beside "
        "|version 0's - version 1's| on the same tokens (the gap one version of staleness makes).",
        "",
        "| KV after the swap | tokens after it | mean gap to version 1 | largest | one version of staleness, "
        "mean | generation s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {kv} | {r['tokens_after_swap']} | {r['mean_gap']:.2e} | {r['max_gap']:.2e} | "
        f"{r['one_version_of_staleness']:.2e} | {r['generation_seconds']:.1f} |"
        for kv, r in ((kv, result[kv]) for kv in ("keep", "recompute"))
    ]
    (Path(args.results_dir) / "inflight_kv.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    args = tyro.cli(Args)
    unknown = set(args.settings) - set(SETTINGS)
    if unknown:
        sys.exit(f"error: --settings {sorted(unknown)} unknown; choose from {list(SETTINGS)}")
    if args.warmup_steps < 1 or args.num_learner_steps < args.warmup_steps + 2:
        sys.exit("error: --warmup-steps must be >= 1 and --num-learner-steps >= --warmup-steps + 2")
    if args.kv_gap and not 1 <= args.kv_swap_step < args.response_length:  # else no swap: keep = recompute
        sys.exit(
            f"error: --kv-swap-step must be >= 1 and below --response-length {args.response_length} (the swap "
            f"happens after that many decoding steps), got {args.kv_swap_step}"
        )
    if not args.kv_gap and "fixed" in args.settings and not 1 <= args.chunk < args.response_length:
        sys.exit(
            f"error: --chunk must be >= 1 and below --response-length {args.response_length} (fixed takes the next "
            f"version after that many decoding steps), got {args.chunk}"
        )
    if not args.kv_gap and args.num_eval_prompts < 1:
        sys.exit(f"error: --num-eval-prompts must be >= 1 (the table's accuracy columns), got {args.num_eval_prompts}")
    if args.kv_gap:
        return kv_gap(args)
    if not args.report_only:
        for path in (args.policy, args.dataset_path):
            if not Path(path).exists():
                sys.exit(f"error: {path} does not exist; run `bash install.sh` first")
        (Path(args.results_dir) / "runs").mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:  # seed by seed: an interrupted sweep leaves whole pairs to compare
            for setting in args.settings:
                path = Path(args.results_dir) / "runs" / f"{setting}__seed{seed}.json"
                if not path.exists():
                    run(args, setting, seed, path)
                elif without_output_dir(json.loads(path.read_text())["command"]) != without_output_dir(
                    command(args, setting, seed, Path("."))[1:]
                ):  # a silent mix would corrupt the table
                    sys.exit(f"error: {path} was made with other flags; delete it or pass another --results-dir")
    report(args)


if __name__ == "__main__":
    main()
