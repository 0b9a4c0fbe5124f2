"""Code meant to be the same is the same, letter for letter: the async/sync twins, and the helpers common to all four.

Each sync baseline is its async script with the orchestration changed, so every function the two define is identical
and the async script only adds the generation thread and its hand-off. Across the four algorithms, the helpers with
nothing algorithm-specific in them (engine plumbing, padding, logprobs, the hand-off) are identical too, so a test run
on one copy (the weight-sync test in test_dpo.py, the thread-crash test) covers every script.
"""

import ast
import functools
import re

import pytest

from conftest import REPO

PAIRS = {algo: (f"async_{algo}.py", f"sync_baselines/sync_{algo}.py") for algo in ("dpo", "rloo", "ppo", "grpo_gsm8k")}
ASYNC_SCRIPTS = [pair[0] for pair in PAIRS.values()]
REWARD_MODEL_SCRIPTS = ["async_dpo.py", "async_rloo.py", "async_ppo.py"]
ASYNC_ONLY = {"generation_thread", "receive", "copy_for_engine"}

COMMON = [
    (name, ASYNC_SCRIPTS) for name in ("build_engine", "generate", "push_weights_to_engine", "keep_models_eager",
                                       "pad_sequences", "response_logits", "token_logprobs", "token_logprobs_no_grad",
                                       "logprob_gap", "prompt_order", "receive", "copy_for_engine", "chunks",
                                       "combine_stats", "learner_autocast", "enable_gradient_checkpointing",
                                       "log_samples", "print_summary", "normalize_number", "extract_answer", "verify",
                                       "grade", "load_problems", "build_prompts", "evaluate", "log_evaluation",
                                       "model_config", "load_tokenizer", "read_records", "create_run_folder",
                                       "start_wandb", "sync_engine", "init_distributed", "wrap_model", "unwrap",
                                       "full_state_dict", "rank_rows", "gather_rows", "from_rank_0", "mean_over_ranks",
                                       "any_rank", "gradient_sync")
] + [
    (name, REWARD_MODEL_SCRIPTS) for name in ("load_prompts", "get_scores", "generation_thread",
                                              "check_reward_tokenizer")
] + [
    ("behaviour_logprobs_tensor", ["async_ppo.py", "async_grpo_gsm8k.py"]),  # the token-level losses
] + [
    (name, ["async_rloo.py", "async_ppo.py", "async_grpo_gsm8k.py"]) for name in ("off_policy_anchor",
                                                                               "clipped_surrogate")
]


@functools.cache  # parsed once per file: ast.get_source_segment is slow on files of ~1,300 lines
def functions(path: str):
    source = (REPO / path).read_text()
    return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef)}


@functools.cache
def main_lines(path: str):
    source = (REPO / path).read_text()
    main = next(node for node in ast.parse(source).body if isinstance(node, ast.If))
    return [line.strip() for line in ast.get_source_segment(source, main).splitlines()]


@pytest.mark.parametrize("algo", PAIRS)
def test_async_and_sync_twins_define_identical_functions(algo):
    async_script, sync_script = PAIRS[algo]
    a, b = functions(async_script), functions(sync_script)
    assert set(a) - set(b) == ASYNC_ONLY and set(b) <= set(a)
    drifted = sorted(name for name in b if a[name] != b[name])
    assert not drifted, f"functions that drifted apart between {async_script} and {sync_script}: {drifted}"


@pytest.mark.parametrize("name,scripts", COMMON, ids=[f"{name}-{len(scripts)}" for name, scripts in COMMON])
def test_common_helpers_are_identical_across_algorithms(name, scripts):
    sources = {script: functions(script).get(name) for script in scripts}
    assert all(sources.values()), f"{name} is missing from {[s for s, src in sources.items() if not src]}"
    assert len(set(sources.values())) == 1, f"{name} differs between {scripts}"


def test_grpo_thread_is_the_common_thread_without_a_reward_model():
    """GRPO's generation thread is the common one, but it has no reward model to pass on."""
    common = functions("async_dpo.py")["generation_thread"].splitlines()
    grpo = functions("async_grpo_gsm8k.py")["generation_thread"].splitlines()
    differing = [(a, b) for a, b in zip(common, grpo) if a != b]
    assert len(common) == len(grpo) and len(differing) == 2
    assert all(a.replace("reward_model, ", "") == b for a, b in differing)


def test_the_learner_side_of_the_hand_off_is_the_same_in_every_async_script():
    def hand_off(path):  # the learner's queue, thread and weight hand-off lines (thread arguments differ by script)
        code = [line.split("  # ")[0] for line in main_lines(path) if not line.startswith(("args=(", "#"))]
        return [line for line in code if re.search(r"queue|thread|\bweights\b", line)]

    reference = hand_off("async_dpo.py")
    assert len(reference) >= 8
    for script in ASYNC_SCRIPTS[1:]:  # after the thread has ended, GRPO loads the final weights to evaluate them
        assert hand_off(script)[: len(reference)] == reference, script
