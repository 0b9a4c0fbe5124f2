"""Code meant to be the same is the same, letter for letter: the async/sync twins, each core and its multigpu variant,
and the helpers common to all four algorithms; and the layout the files promise a reader (the order of the sections,
`main()` before one PLUMBING banner, the loop's callees above it, light lines where a reader starts).

Each sync baseline is its core with the orchestration changed, so every function the two define is identical and the
async core only adds the generation thread and its hand-off. Each multigpu variant is its core plus torchrun, a
tensor-parallel engine and exact resume: every function both define is identical but for a short, named list. Across
the four algorithms, the helpers with nothing algorithm-specific in them (engine plumbing, padding, logprobs, the
hand-off) are identical too, so a test run on one copy (the weight-sync test in test_dpo.py, the thread-crash test)
covers every script. And what the twins compute is the same: with --async-steps 0 each core logs, step by step, the
numbers its sync twin logs, and saves the same weights.
"""

import ast
import functools
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file

from conftest import ENV, REPO, read_metrics, run_script

ALGOS = ("dpo", "rloo", "ppo", "grpo_gsm8k")
PAIRS = {algo: (f"async_{algo}.py", f"sync_baselines/sync_{algo}.py") for algo in ALGOS}
MULTIGPU = {algo: f"multigpu/async_{algo}_multigpu.py" for algo in ALGOS}
INFLIGHT = "async_grpo_gsm8k_inflight.py"  # the GRPO core with in-flight weight updates (issue 45)
LORA = "async_dpo_lora.py"  # the DPO core with LoRA adapters handed to the engine (issue 56)
GRPO_LORA = "async_grpo_gsm8k_lora.py"  # the GRPO core with the same LoRA changes (issue 56)
TOOLS = "async_grpo_gsm8k_tools.py"  # the GRPO core whose policy calls a calculator (issue 57)
ASYNC_SCRIPTS = [pair[0] for pair in PAIRS.values()]
REWARD_MODEL_SCRIPTS = ["async_dpo.py", "async_rloo.py", "async_ppo.py"]
ASYNC_ONLY = {"PolicyVersion", "generation_thread", "receive"}  # the thread and what it is handed
# what scaling out changes in a function the core also has: the flags, the engine's placement and weight transport,
# the ranks' shares of a batch, the thread's resume and spare copies, and the signal handling that saves a checkpoint
MULTIGPU_CHANGES = {
    "Args",
    "RunArgs",
    "check_args",
    "build_engine",
    "push_weights_to_engine",
    "sync_engine",
    "generation_thread",
    "token_logprobs_no_grad",
    "stop_requests",
    "get_values",
    "main",
    "start_tracking",
    "save_final",
    "choose_micro_batch_size",
    "WeightCheck",
    "weight_check",
    "check_weight_sync",
}  # and the micro-batch: on a GPU from its free memory, alike on every rank
# what in-flight weight updates change in the GRPO core: the flags and their checks, step-by-step decoding with each
# token's version, the in-flight push and guard, the thread that swaps, the engine's scheduling, the loop's metrics
INFLIGHT_CHANGES = {
    "Args",
    "check_args",
    "generate",
    "produce_batch",
    "push_weights_to_engine",
    "check_weight_sync",
    "generation_thread",
    "build_engine",
    "main",
    "print_summary",  # the in-flight line: mode, chunk, versions taken mid-batch, token staleness
}
# what LoRA changes in the DPO core: the flags and their checks, the engine's adapters, sampling with one, the
# adapter hand-off and its guard (which replaces the weight check), the thread that swaps adapters, the loop
LORA_CHANGES = {
    "Args",
    "RunArgs",  # the adapters' folder, computed at runtime
    "check_args",
    "build_engine",
    "generate",
    "produce_batch",
    "push_weights_to_engine",
    "check_weight_sync",
    "generation_thread",
    "main",
    "PolicyVersion",  # no weights: the adapter goes through its folder, and the hand-off carries its version and check
}
# and in the GRPO core: greedy evaluation through the version's adapter, and the final hand-off after the thread ended
GRPO_LORA_CHANGES = LORA_CHANGES | {"evaluate", "sync_engine"}
# the LoRA code with nothing algorithm-specific in it, letter for letter the same in both LoRA variants: the flags'
# check, the engine's adapters, sampling with one, the hand-off, its folder and its guard, the policy, the merged save
LORA_COMMON = (
    "PolicyVersion",
    "check_lora_args",
    "build_engine",
    "generate",
    "push_weights_to_engine",
    "make_adapter_dir",
    "adapter_request",
    "save_adapter",
    "engine_adapter_mismatches",
    "check_weight_sync",
    "load_lora_policy",
    "save_merged",
)
# what tool calls change in the GRPO core: the flags, sampling that continues each sequence after a call (and the
# greedy evaluation with it), the batch's tool masks and counts, the loop's policy-token mask and tool metrics
TOOLS_CHANGES = {"Args", "RunArgs", "generate", "evaluate", "produce_batch", "main"}
# every script a reader may open: the cores, their sync twins and multigpu variants, the variants beside the cores
SCRIPTS = [*ASYNC_SCRIPTS, *(pair[1] for pair in PAIRS.values()), *MULTIGPU.values(), INFLIGHT, TOOLS, LORA, GRPO_LORA]
# what the learner loop and the generation thread may call below the PLUMBING banner (STYLE.md, habit 11): logging
# (with what only the log reads: the vLLM-learner logprob gap, the importance weights' effective sample size, GRPO's
# greedy held-out evaluation), saving, and the guard's engine half (`push_weights_to_engine`, the one other vLLM call,
# stays above, in GENERATION)
BELOW_THE_BANNER = {
    "log_step",
    "logprob_gap",
    "effective_sample_size",
    "evaluate",
    "log_samples",
    "log_evaluation",
    "save_policy",
    "check_weight_sync",
    "engine_mismatches",
}
# and in a multigpu variant its scale-out plumbing, the same in all four (COMMON below), and the checkpoint it saves
MULTIGPU_BELOW_THE_BANNER = {
    "any_rank",
    "copy_for_engine",
    "from_rank_0",
    "full_state_dict",
    "gather_rows",
    "gradient_sync",
    "mean_over_ranks",
    "rank_rows",
    "record_batch",
    "recorded_batch",
    "save_checkpoint",
}
# the flags a reader meets first (Args) hold no run plumbing: these are RunArgs's, below the banner
RUN_FLAGS = {
    "queue_timeout",
    "gpu_memory_utilization",
    "kv_cache_gib",
    "max_prompt_tokens",
    "micro_batch_size",
    "learner_dtype",
    "seed",
    "track",
    "output_dir",
    "save_every",
    "torch_threads",
    "run_name",
    "learner_device",
    "eos_token_ids",
}
LOSS = {
    "dpo": "dpo_loss(",
    "rloo": "clipped_policy_loss(",
    "grpo_gsm8k": "grpo_policy_loss(",
    "ppo": "clipped_policy_loss(",
}

COMMON = (
    [
        (name, ASYNC_SCRIPTS)
        for name in (
            "build_engine",
            "generate",
            "push_weights_to_engine",
            "PolicyVersion",
            "WeightCheck",
            "GuardState",
            "weight_check",
            "check_weight_sync",
            "engine_mismatches",
            "keep_models_eager",
            "pad_sequences",
            "token_logprobs",
            "logprob_gap",
            "prompt_order",
            "receive",
            "chunks",
            "token_logprobs_no_grad",
            "combine_stats",
            "learner_autocast",
            "enable_gradient_checkpointing",
            "extract_answer",
            "verify",
            "model_config",
            "load_tokenizer",
            "read_records",
            "create_run_folder",
            "save_policy",
            "stop_requests",
            "choose_micro_batch_size",
            "start_tracking",
            "log_step",
            "log_samples",
            "save_final",
            "load_causal_lm",
        )
    ]
    + [
        (name, REWARD_MODEL_SCRIPTS)
        for name in (
            "load_prompts",
            "get_scores",
            "score_responses",
            "generation_thread",
            "print_summary",
            "split_into_steps",
            "load_scalar_model",
        )
    ]
    + [(name, [LORA, GRPO_LORA]) for name in LORA_COMMON]
    + [
        ("behaviour_logprobs_tensor", ["async_rloo.py", "async_ppo.py", "async_grpo_gsm8k.py"]),  # per-token weights
    ]
    + [
        (name, ["async_rloo.py", "async_ppo.py", "async_grpo_gsm8k.py"])
        for name in ("off_policy_anchor", "clipped_surrogate")
    ]
    + [  # the multigpu variants share their scale-out plumbing
        (name, list(MULTIGPU.values()))
        for name in (
            "init_distributed",
            "wrap_model",
            "unwrap",
            "full_state_dict",
            "rank_rows",
            "gather_rows",
            "from_rank_0",
            "mean_over_ranks",
            "any_rank",
            "gradient_sync",
            "copy_for_engine",
            "push_weights_to_engine",
            "sync_engine",
            "token_logprobs_no_grad",
            "replay_flags",
            "record_batch",
            "check_replay",
            "recorded_batch",
            "start_tracking",
            "save_final",
            "resume_run_folder",
            "check_hand_off_room",
            "stop_requests",
            "choose_micro_batch_size",
            "learner_gpu_budget",
            "WeightCheck",
            "weight_check",
            "check_weight_sync",
            "bit_checksum",
            "fused_checksum",
            "engine_checksums",
        )
    ]
)


@functools.cache  # parsed once per file
def functions(path: str):
    source = (REPO / path).read_text()
    return {
        node.name: ast.get_source_segment(source, node)
        for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }


@functools.cache
def main_lines(path: str):
    return [line.strip() for line in functions(path)["main"].splitlines()]


@pytest.mark.parametrize("algo", ALGOS)
def test_async_and_sync_twins_define_identical_functions(algo):
    async_script, sync_script = PAIRS[algo]
    a, b = functions(async_script), functions(sync_script)
    assert set(a) - set(b) == ASYNC_ONLY and set(b) <= set(a)
    drifted = sorted(name for name in b if name not in ("Args", "RunArgs", "main") and a[name] != b[name])
    assert not drifted, f"functions that drifted apart between {async_script} and {sync_script}: {drifted}"


def twin_flags(algo, tiny, arithmetic_folder):
    """Three learner steps of two mini-batches each (so that an update also sees a policy the step has moved), on the
    tiny models; GRPO on generated problems, with enough groups of mixed rewards that its loss is not always 0."""
    common = (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--response-length",
        "16",
        "--num-learner-steps",
        "3",
        "--num-mini-batches",
        "2",
        "--learning-rate",
        "3e-3",
        "--seed",
        "3",
        "--sample-every",
        "2",
    )
    if algo == "grpo_gsm8k":
        return (
            *common,
            "--dataset-path",
            str(arithmetic_folder),
            "--max-prompt-tokens",
            "256",
            "--prompts-per-step",
            "16",
            "--num-samples-per-prompt",
            "4",
            "--temperature",
            "1.0",
            "--num-eval-prompts",
            "8",
            "--eval-every",
            "2",
            "--kv-cache-gib",
            "0.25",
        )
    return (
        *common,
        "--reward-model-path",
        str(tiny / "rm"),
        "--dataset-name",
        str(tiny / "prompts.jsonl"),
        "--max-prompt-tokens",
        "64",
        "--prompts-per-step",
        "4",
        "--num-samples-per-prompt",
        "2",
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_the_async_core_with_zero_async_steps_is_its_sync_twin_and_its_multigpu_variant(
    algo, tiny, arithmetic_folder, tmp_path
):
    """--async-steps 0: the generation thread hands over each batch made with the learner's current weights, which is
    what the sync twin does in line; with the same flags and seed the core, the twin and the multigpu variant in one
    process (test_distributed.py runs it under torchrun) log the same numbers at every step (but the times), bit for
    bit, evaluate alike (GRPO) and save the same policy. The three runs go side by side."""
    runs = {
        "async": (PAIRS[algo][0], ("--async-steps", "0")),
        "sync": (PAIRS[algo][1], ()),
        "multigpu": (MULTIGPU[algo], ("--async-steps", "0")),
    }
    for name in runs:
        (tmp_path / name).mkdir()
    with ThreadPoolExecutor(len(runs)) as pool:
        done = {
            name: pool.submit(
                run_script,
                script,
                tmp_path / name,
                *twin_flags(algo, tiny, arithmetic_folder),
                *extra,
                "--output-dir",
                str(tmp_path / name / "model"),
            )
            for name, (script, extra) in runs.items()
        }
    for name, future in done.items():
        proc, _ = future.result()
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
    core, *others = (read_metrics(tmp_path / name) for name in runs)
    assert [m["step"] for m in core] == [0, 1, 2]
    assert [m["async/actor_version"] for m in core] == [0, 1, 2]  # K = 0 indeed: every batch from the current policy
    loss = "losses/dpo_loss" if algo == "dpo" else "losses/policy_loss"
    assert len({m[loss] for m in core}) > 1, "the loss never changed: the test would prove nothing"
    for name, other in zip(list(runs)[1:], others):
        assert [m["step"] for m in other] == [0, 1, 2], name
        for step, (c, t) in enumerate(zip(core, other)):
            assert set(c) == set(t), (name, step)
            differ = sorted(key for key in c if not key.startswith("time/") and c[key] != t[key])
            assert not differ, f"{name}, step {step}: " + ", ".join(f"{key} {c[key]!r} != {t[key]!r}" for key in differ)
    if algo == "grpo_gsm8k":  # the evaluations of policy versions 0, 2 and the final 3
        core, *others = (
            [
                {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
                for line in next((tmp_path / name / "runs").glob("*/eval.jsonl")).read_text().splitlines()
            ]
            for name in runs
        )
        assert [e["policy_version"] for e in core] == [0, 2, 3] and all(core == other for other in others)
    weights = [load_file(tmp_path / name / "model" / "model.safetensors") for name in runs]
    for other in weights[1:]:
        assert weights[0].keys() == other.keys()
        assert all(weights[0][key].equal(other[key]) for key in weights[0])


@pytest.mark.parametrize("algo", ALGOS)
def test_the_multigpu_variant_is_the_core_plus_scale_out(algo):
    core, variant = functions(PAIRS[algo][0]), functions(MULTIGPU[algo])
    # the core's policy snapshot becomes a whole checkpoint (optimizer, random states, batches in flight); the core's
    # guard compares the engine's tensors with the learner's in its own process, the variant's checksums of them
    # (its engine's workers may be other processes)
    # the core's seeds and devices are init_distributed's placement of ranks and the variant's main's seeding
    assert set(core) - set(variant) <= {"save_policy", "engine_mismatches", "seed_and_place"}
    assert "save_checkpoint" in variant
    assert {"bit_checksum", "fused_checksum", "engine_checksums"} <= set(variant) - set(core)
    changed = sorted(name for name in core if name in variant and core[name] != variant[name])
    assert set(changed) <= MULTIGPU_CHANGES, f"changed outside the list: {sorted(set(changed) - MULTIGPU_CHANGES)}"


def test_the_in_flight_variant_is_the_grpo_core_plus_in_flight_updates():
    core, variant = functions(PAIRS["grpo_gsm8k"][0]), functions(INFLIGHT)
    assert set(core) == set(variant)
    changed = sorted(name for name in core if core[name] != variant[name])
    assert set(changed) <= INFLIGHT_CHANGES, f"changed outside the list: {sorted(set(changed) - INFLIGHT_CHANGES)}"


def test_the_lora_variant_is_the_dpo_core_plus_adapters():
    core, variant = functions(PAIRS["dpo"][0]), functions(LORA)
    # the adapter's check is save_adapter's; the engine's comparison with the pushed weights is the weight guard's
    assert set(core) - set(variant) == {"weight_check", "engine_mismatches"}
    changed = sorted(name for name in core if name in variant and core[name] != variant[name])
    assert set(changed) <= LORA_CHANGES, f"changed outside the list: {sorted(set(changed) - LORA_CHANGES)}"


def test_the_grpo_lora_variant_is_the_grpo_core_plus_the_same_adapters():
    """The DPO variant's LoRA changes on the GRPO core: the same functions go and come, the LoRA code that knows no
    algorithm is the DPO variant's letter for letter (LORA_COMMON, with the constants it reads), and the base is never
    reloaded: no full-weight transport is left in the file."""
    core, variant = functions(PAIRS["grpo_gsm8k"][0]), functions(GRPO_LORA)
    assert set(core) - set(variant) == {"weight_check", "engine_mismatches"}
    assert set(variant) - set(core) == set(functions(LORA)) - set(functions(PAIRS["dpo"][0]))
    changed = sorted(name for name in core if name in variant and core[name] != variant[name])
    assert set(changed) <= GRPO_LORA_CHANGES, f"changed outside the list: {sorted(set(changed) - GRPO_LORA_CHANGES)}"
    assert set(LORA_COMMON) == set(variant) - set(core) | (LORA_CHANGES & {n for n, s in COMMON if s == ASYNC_SCRIPTS})
    for constant in ("LORA_MODULES = {", "VLLM_LORA_RANKS = ("):
        blocks = [(REPO / path).read_text().split(constant)[1].split("\n\n")[0] for path in (LORA, GRPO_LORA)]
        assert blocks[0] == blocks[1], constant
    assert not re.search(r"reload_weights|reset_prefix_cache", (REPO / GRPO_LORA).read_text())


def test_the_tool_variant_is_the_grpo_core_plus_tool_calls():
    core, variant = functions(PAIRS["grpo_gsm8k"][0]), functions(TOOLS)
    assert set(core) <= set(variant)
    changed = sorted(name for name in core if core[name] != variant[name])
    assert set(changed) <= TOOLS_CHANGES, f"changed outside the list: {sorted(set(changed) - TOOLS_CHANGES)}"


@pytest.mark.parametrize("name,scripts", COMMON, ids=[f"{name}-{len(scripts)}" for name, scripts in COMMON])
def test_common_helpers_are_identical_across_algorithms(name, scripts):
    sources = {script: functions(script).get(name) for script in scripts}
    assert all(sources.values()), f"{name} is missing from {[s for s, src in sources.items() if not src]}"
    assert len(set(sources.values())) == 1, f"{name} differs between {scripts}"


def test_the_engine_processes_start_alike_in_every_multigpu_variant():
    """The top of each variant, which vLLM's engine processes run first (as __mp_main__): their own session, the death
    signal, and SIGINT/SIGTERM blocked but for their parent's (issue 55), the same in all four."""
    blocks = set()
    for path in MULTIGPU.values():
        source = (REPO / path).read_text()
        (block,) = [
            ast.get_source_segment(source, node)
            for node in ast.parse(source).body
            if isinstance(node, ast.If) and "__mp_main__" in ast.unparse(node.test)
        ]
        blocks.add(block)
    assert len(blocks) == 1 and "sigwaitinfo" in blocks.pop()


def test_the_learner_side_of_the_hand_off_is_the_same_in_every_async_script():
    def hand_off(path):  # the learner's queue, thread and weight hand-off lines (the thread's arguments differ)
        code = [
            line.split("  # ")[0]
            for line in main_lines(path)
            if not line.startswith(("args=(", "thread_args = (", "#"))
        ]
        return [line for line in code if re.search(r"queue|thread|\bweights\b", line)]

    reference = hand_off("async_dpo.py")
    assert len(reference) >= 6
    for script in ASYNC_SCRIPTS[1:]:  # after the thread has ended, GRPO loads the final weights to evaluate them
        assert hand_off(script)[: len(reference)] == reference, script


@pytest.mark.parametrize("algo", ALGOS)
def test_every_file_reads_in_the_same_order_and_points_at_its_docs(algo):
    """Args, the algorithm, reward, generation, `main()`, then one PLUMBING banner and what a reader may skip; line 1
    names the docs page; the file ends by calling `main()`."""
    for path in (
        *PAIRS[algo],
        MULTIGPU[algo],
        *[INFLIGHT, TOOLS, GRPO_LORA] * (algo == "grpo_gsm8k"),
        *[LORA] * (algo == "dpo"),
    ):
        source = (REPO / path).read_text()
        assert source.startswith("# docs: docs/"), path
        assert (REPO / source.split()[2].split("#")[0]).exists(), path
        banners = [
            source.index(banner)
            for banner in (
                "class Args",
                "# ALGO LOGIC",
                "# REWARD",
                "# GENERATION",
                "\ndef main():",
                "\n# PLUMBING",
                "\nclass RunArgs(Args):",
                "\n# DATA",
                "\n# vLLM",
            )
        ]
        assert banners == sorted(banners), path
        assert source.count("\n# PLUMBING") == 1, path
        assert source.rstrip().endswith('if __name__ == "__main__":\n    main()'), path


def reading_part(path: str):
    """The lines above the PLUMBING banner: what a reader meets first."""
    lines = (REPO / path).read_text().splitlines()
    return lines[: next(i for i, line in enumerate(lines) if line.startswith("# PLUMBING"))]


def learner_loop(path: str):
    """`main()`'s loop over the learner steps (the generation thread's own loop is in its function)."""
    main = next(node for node in ast.parse((REPO / path).read_text()).body if getattr(node, "name", "") == "main")
    return next(node for node in ast.walk(main) if isinstance(node, ast.For) and "step" in ast.unparse(node.target))


@pytest.mark.parametrize("algo", ALGOS)
def test_each_core_reads_algorithm_first(algo):
    """STYLE.md habit 11: the loop starts in the first half of the file and calls the loss on its first screen (within
    55 lines of its start: the 45 of the packed files, as the formatter breaks them)."""
    source = (REPO / PAIRS[algo][0]).read_text().splitlines()
    loop = learner_loop(PAIRS[algo][0]).lineno
    loss = next(i for i, line in enumerate(source, 1) if i > loop and LOSS[algo] in line)
    assert loop < len(reading_part(PAIRS[algo][0])) and loop < len(source) / 2, (loop, len(source))
    assert loss - loop <= 55, loss - loop


@pytest.mark.parametrize("path", SCRIPTS)
def test_the_flags_a_reader_meets_first_are_the_lesson(path):
    """`Args`, at the top, holds the algorithm, K, generation and the model and data; `RunArgs(Args)`, the first thing
    below the banner, the run's other flags, and `main()` parses both as one flat set of flags."""
    source = (REPO / path).read_text()
    tree = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    fields = {
        name: {f.target.id for f in tree[name].body if isinstance(f, ast.AnnAssign)} for name in ("Args", "RunArgs")
    }
    assert not fields["Args"] & RUN_FLAGS, sorted(fields["Args"] & RUN_FLAGS)
    assert RUN_FLAGS - ({"queue_timeout"} if path.startswith("sync_") else set()) <= fields["RunArgs"], path
    assert "\n# PLUMBING" in source and source.split("\n# PLUMBING")[1].split("\n", 2)[1:2] == ["@dataclass"], path
    assert "class RunArgs(Args):" in source.split("\n# PLUMBING")[1].split("\n\n")[0] and "tyro.cli(RunArgs)" in source


@pytest.mark.parametrize("path", SCRIPTS)
def test_the_loop_and_the_thread_call_nothing_below_the_banner_but_logging_saving_and_the_guard(path):
    """A reader follows every call the learner loop and the generation thread make without leaving the reading part,
    but logging, saving and the guard's engine half (in a multigpu variant also its scale-out plumbing)."""
    source = (REPO / path).read_text()
    banner = len(reading_part(path))
    defined = {
        node.name: node.lineno for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    callers = [learner_loop(path)] + [
        node for node in ast.parse(source).body if getattr(node, "name", "") == "generation_thread"
    ]
    called = {
        call.func.id
        for caller in callers
        for call in ast.walk(caller)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in defined
    }
    allowed = BELOW_THE_BANNER | (MULTIGPU_BELOW_THE_BANNER if path.startswith("multigpu/") else set())
    below = sorted(name for name in called - allowed if defined[name] > banner)
    assert not below, f"{path}: the loop or the thread calls {below}, defined below the PLUMBING banner"


@pytest.mark.parametrize("path", SCRIPTS)
def test_the_reading_part_has_few_long_and_closer_only_lines(path):
    """One idea per line, as `ruff format` leaves it (habit 11), measured where a reader starts: at most 1 in 20 of
    the lines above the banner runs over 100 characters (prose is wrapped at 100) or holds only closing brackets."""
    lines = reading_part(path)
    long = sum(len(line) > 100 for line in lines) / len(lines)
    closers = sum(bool(re.fullmatch(r"[)\]}]+[,:]?", line.strip())) for line in lines) / len(lines)
    assert long <= 0.05 and closers <= 0.05, (path, round(long, 3), round(closers, 3))


PINNED = {
    "VLLM_USE_BYTECODE_HOOK": "0",
    "VLLM_FLOAT32_MATMUL_PRECISION": "highest",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "TRITON_F32_DEFAULT": "ieee",
}


@pytest.mark.parametrize("script", ["async_dpo.py", MULTIGPU["dpo"]])
@pytest.mark.slow
def test_process_wide_vllm_settings_are_pinned_before_vllm_reads_them(script):
    """docs/async.md, design decision 17: in a real import, with the opposite values inherited, vLLM reads the bytecode
    hook off, float32 matmuls at "highest" (both forced), the V1 model runner and IEEE Triton float32 (defaults), and
    every script sets them the same way before it imports vllm."""
    code = (
        f"import runpy, sys; sys.argv = ['x']; runpy.run_path({str(REPO / script)!r}, run_name='imported'); "
        "import os, json, vllm.envs as e; print(json.dumps({n: os.environ[n] for n in " + repr(list(PINNED)) + "}),"
        " e.VLLM_USE_BYTECODE_HOOK, e.VLLM_USE_V2_MODEL_RUNNER, e.VLLM_FLOAT32_MATMUL_PRECISION)"
    )
    env = {k: v for k, v in ENV.items() if k not in PINNED} | {
        "VLLM_USE_BYTECODE_HOOK": "1",
        "VLLM_FLOAT32_MATMUL_PRECISION": "high",
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    values, hook, v2, precision = proc.stdout.strip().splitlines()[-1].rsplit(" ", 3)
    assert json.loads(values) == PINNED and (hook, v2, precision) == ("False", "False", "highest")
    for path in [*ASYNC_SCRIPTS, *(pair[1] for pair in PAIRS.values()), *MULTIGPU.values()]:
        source = (REPO / path).read_text()
        head = source[: source.index("\nfrom vllm import")]
        assert 'VLLM_USE_BYTECODE_HOOK="0"' in head and 'os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")' in head
        assert "VLLM_FLOAT32_MATMUL_PRECISION" in head and 'os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")' in head
