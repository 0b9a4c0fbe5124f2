"""Issue 42's guard table, re-run: does the weight-sync guard stop every skipped, stuck or partial push, and pass every
healthy one, in float32 and bfloat16, at large and tiny learning rates? And what does it cost per version?

    python benchmark/guard_table.py                 # every row; writes benchmark/results/guard_table/guard.{md,json}
    python benchmark/guard_table.py --rows 0 3      # some rows (their indices in ROWS)

Each row is one learner and the real vLLM engine of `async_dpo.py` (in this process, CPU, one torch thread), driven
as the scripts drive them: version 0 checked, then per version one AdamW step (the scripts' eps) on a fixed sentence,
`weight_check` on the learner, `push_weights_to_engine` (unless the row's fault withholds it) and `check_weight_sync`.
Faults: `skip` (the push of one version never happens), `stuck` (no push from that version on), `partial-norms` (a
push without the layer norms), `partial-linear` (a push without one attention projection: on vLLM's CPU backend the
linear layers are repacked and show no bits, so only the probe can see it), `stale-body` (from that version on, the
linear layers' weights stay those of the version before while the norms, biases, embeddings and head are pushed: the
body of an old version under a fresh head). The healthy rows at lr 1e-4 to 3e-3 calibrate the bfloat16 tolerance
(issue 55) on three models. Tiny models (a Llama and a GPT-NeoX as in Pythia) are built offline as the tests build
them; SmolLM2 is models/SmolLM2-135M-Instruct (`bash install.sh cpu`). Each (model, dtype) runs in a subprocess of
its own (one engine per process); the guard's coverage line of each is in the report.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import common

REPO = common.REPO
WORK = REPO / "benchmark" / "work" / "guard"
RESULTS = REPO / "benchmark" / "results" / "guard_table"
# (model, engine dtype, learning rate, fault, version the fault starts at, versions): issue 42's rows first
ROWS = [
    ("tiny", "float32", 3e-3, "skip", 3, 6),
    ("tiny", "bfloat16", 3e-4, "skip", 3, 6),
    ("tiny", "float32", 1e-5, "skip", 3, 6),
    ("tiny", "bfloat16", 1e-5, "skip", 3, 6),
    ("smollm2", "bfloat16", 3e-7, "stuck", 2, 7),
    ("tiny", "bfloat16", 1e-5, "stuck", 2, 6),
    ("smollm2", "bfloat16", 3e-6, "partial-norms", 3, 6),
    ("smollm2", "bfloat16", 3e-6, "partial-linear", 3, 6),
    ("smollm2", "float32", 3e-6, "partial-linear", 3, 6),
    ("tiny", "float32", 1e-5, "partial-linear", 3, 6),
    ("tiny", "float32", 1e-5, "healthy", 0, 10),
    ("tiny", "bfloat16", 1e-5, "healthy", 0, 10),
    ("smollm2", "float32", 3e-6, "healthy", 0, 10),
    ("smollm2", "bfloat16", 3e-6, "healthy", 0, 10),
    # issue 55: a stale body under a fresh head, and the healthy bfloat16 gap at high learning rates, on three models
    ("tiny", "bfloat16", 3e-6, "stale-body", 3, 8),
    ("tiny", "bfloat16", 1e-3, "stale-body", 3, 8),
    ("neox", "bfloat16", 3e-6, "stale-body", 3, 8),
    ("neox", "bfloat16", 1e-3, "stale-body", 3, 8),
    ("smollm2", "bfloat16", 3e-6, "stale-body", 3, 8),
    ("smollm2", "bfloat16", 1e-4, "stale-body", 3, 8),
    ("neox", "float32", 1e-5, "healthy", 0, 10),
    ("neox", "bfloat16", 1e-5, "healthy", 0, 10),
    ("tiny", "bfloat16", 1e-4, "healthy", 0, 10),
    ("tiny", "bfloat16", 1e-3, "healthy", 0, 10),
    ("tiny", "bfloat16", 3e-3, "healthy", 0, 10),
    ("neox", "bfloat16", 1e-4, "healthy", 0, 10),
    ("neox", "bfloat16", 1e-3, "healthy", 0, 10),
    ("neox", "bfloat16", 3e-3, "healthy", 0, 10),
    ("smollm2", "bfloat16", 1e-4, "healthy", 0, 10),
    ("smollm2", "bfloat16", 1e-3, "healthy", 0, 10),
    ("smollm2", "bfloat16", 3e-3, "healthy", 0, 10),
]


def model_path(name: str) -> Path:
    if name == "smollm2":
        return REPO / "models" / "SmolLM2-135M-Instruct"
    if not (WORK / "tiny" / "policy").exists():
        common.load_script("tools/make_tiny_models.py").build_tiny_models(WORK / "tiny")  # the tests' tiny models
    return WORK / "tiny" / ("neox_policy" if name == "neox" else "policy")


def run_group(model: str, dtype: str, rows: list) -> list:
    """The rows of one (model, dtype) in this process: one engine, a fresh learner per row."""
    dpo = common.load_script("async_dpo.py")  # sets the engine-in-process variable before vLLM is imported
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dpo.SET_TORCH_THREADS(1)
    path = str(model_path(model))
    args = dpo.RunArgs(
        model_name_or_path=path,
        engine_dtype=dtype,
        engine_device="cpu",
        learner_device="cpu",
        kv_cache_gib=0.25,
        gpu_memory_utilization=0.1,
        max_prompt_tokens=96,
        response_length=16,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    # loaded before the engine, as in the scripts: a GPT-NeoX engine patches the class; each row starts from a copy
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    initial = {n: t.clone() for n, t in policy.state_dict().items()}
    llm = dpo.build_engine(args)
    text = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
        "clips did Natalia sell altogether?"
    )
    probe = (tokenizer(text).input_ids * 8)[:32]  # as the scripts' probe: a prompt repeated to 32 tokens
    train = torch.tensor(
        [
            tokenizer(
                "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of "
                "babysitting. How much did she earn? #### 10"
            ).input_ids
        ]
    )
    results = []
    for index, (lr, fault, start, versions) in rows:
        policy.load_state_dict(initial)
        dpo.keep_models_eager(policy)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, eps=1e-5, weight_decay=0.0)
        dpo.push_weights_to_engine(llm, policy.state_dict())  # the engine starts from this learner's weights
        guard_state = dpo.check_weight_sync(llm, dpo.weight_check(policy, probe, args), None, args, 0)
        row = dict(
            index=index,
            model=model,
            engine_dtype=dtype,
            learning_rate=lr,
            fault=fault,
            start=start,
            versions=versions,
            stopped_at=None,
            reason=None,
            gaps=[],
            learner_moves=[],
            learner_check_s=[],
            engine_check_s=[],
            push_s=[],
        )
        for version in range(1, versions + 1):
            optimizer.zero_grad()
            (-dpo.token_logprobs(policy, train, torch.ones_like(train), torch.ones_like(train), 1.0).sum()).backward()
            optimizer.step()
            t0 = time.perf_counter()
            expected = dpo.weight_check(policy, probe, args)
            t1 = time.perf_counter()
            weights = policy.state_dict()
            if fault == "partial-norms" and version == start:
                weights = {n: t for n, t in weights.items() if "norm" not in n}
            if fault == "partial-linear" and version == start:
                weights = {n: t for n, t in weights.items() if "layers.0.self_attn.q_proj" not in n}
            if fault == "stale-body" and version == start - 1:  # the body of this version stays in the engine
                body = {n: t.clone() for n, t in weights.items() if is_body(n, t)}
            if fault == "stale-body" and version >= start:
                weights = {**weights, **body}
            withheld = (fault == "skip" and version == start) or (fault == "stuck" and version >= start)
            if not withheld:
                dpo.push_weights_to_engine(llm, weights)
            t2 = time.perf_counter()
            row["learner_moves"].append((expected.logprobs - guard_state.learner_logprobs).abs().mean().item())
            try:
                guard_state = dpo.check_weight_sync(llm, expected, guard_state, args, version)
            except RuntimeError as error:
                row["stopped_at"], row["reason"] = version, str(error)
                break
            finally:
                row["learner_check_s"].append(t1 - t0)
                row["push_s"].append(t2 - t1)
                row["engine_check_s"].append(time.perf_counter() - t2)
            row["gaps"].append((guard_state.engine_logprobs - expected.logprobs).abs().mean().item())
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def is_body(name: str, tensor) -> bool:
    """A linear layer's weight: the matrices of the body, not the embeddings or the output layer."""
    return name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in ("embed", "lm_head"))


def verdict(row: dict) -> str:
    if row["fault"] == "healthy":
        return (
            "passes every version ✓" if row["stopped_at"] is None else f"**stops a healthy run** at {row['stopped_at']}"
        )
    if row["stopped_at"] is None:
        return "**never stops**"
    return (
        f"stops at version {row['stopped_at']} ✓"
        if row["stopped_at"] == row["start"]
        else f"stops late, at version {row['stopped_at']}"
    )


def report(results: list, coverage: dict):
    lines = [
        "Issue 42's guard table, re-run by `python benchmark/guard_table.py` (real CPU vLLM engine in process, one "
        "torch thread; the tiny Llama and the tiny GPT-NeoX of the tests, SmolLM2-135M-Instruct). A fault starts at "
        "the version in its column; `healthy` rows push every version. The last column is the largest gap of the "
        "versions that passed (for a fault that is never stopped: with the fault).",
        "",
        "| model | engine dtype | lr | fault (from version) | guard | why it stopped | largest healthy gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(results, key=lambda r: r["index"]):
        why = (row["reason"] or "").split("(", 1)[-1].rstrip(")") if row["reason"] else ""
        gap = f"{max(row['gaps']):.1e}" if row["gaps"] else "-"
        lines.append(
            f"| {row['model']} | {row['engine_dtype']} | {row['learning_rate']:g} | {row['fault']} "
            f"({row['start']}) | {verdict(row)} | {why} | {gap} |"
        )
    lines += [
        "",
        "Cost per version of the healthy rows (median over versions, CPU, one thread): the learner's "
        "`weight_check` (probe forward) and the engine's `check_weight_sync` (probe generation + the tensors "
        "compared in the engine's worker through `collective_rpc`), beside the push itself.",
        "",
        "| model | engine dtype | learner check (s) | engine check (s) | push (s) |",
        "|---|---|---|---|---|",
    ]
    median = lambda xs: sorted(xs)[len(xs) // 2]
    for row in sorted(results, key=lambda r: r["index"]):
        if row["fault"] == "healthy":
            lines.append(
                f"| {row['model']} | {row['engine_dtype']} | {median(row['learner_check_s']):.3f} | "
                f"{median(row['engine_check_s']):.3f} | {median(row['push_s']):.3f} |"
            )
    lines += ["", "The guard's start-up line, per (model, engine dtype), on this CPU engine:", ""]
    lines += [f"- {model} {dtype}: `{line}`" for (model, dtype), line in coverage.items()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "guard.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "guard.json").write_text(json.dumps(sorted(results, key=lambda r: r["index"]), indent=1))
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", help="indices in ROWS (default: all)")
    parser.add_argument("--group", help=argparse.SUPPRESS)  # internal: run one (model, dtype) group, print JSON lines
    flags = parser.parse_args()
    chosen = [(i, ROWS[i]) for i in (flags.rows if flags.rows is not None else range(len(ROWS)))]
    if flags.group:
        model, dtype = flags.group.split(":")
        run_group(model, dtype, [(i, row[2:]) for i, row in chosen if row[:2] == (model, dtype)])
        return
    results, coverage = [], {}
    for group in dict.fromkeys(row[:2] for _, row in chosen):
        cmd = [sys.executable, __file__, "--group", ":".join(group), "--rows", *(str(i) for i, _ in chosen)]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", **__import__("os").environ},
        )
        if proc.returncode != 0:
            sys.exit(f"guard_table: the group {group} failed:\n{proc.stderr[-3000:]}")
        results += [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"index"')]
        coverage[group] = next((line for line in proc.stdout.splitlines() if line.startswith("guard:")), "")
    report(results, coverage)


if __name__ == "__main__":
    main()
