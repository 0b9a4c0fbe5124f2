"""`--reward verifier` in online DPO, RLOO and PPO: the paper's GSM8K setting, where an exact-match verifier replaces
the reward model; and tools/evaluate.py, their held-out evaluation after the fact. Real runs of the tiny policy on
generated arithmetic problems (GSM8K format), on a real engine."""

import json
import re

import pytest

from conftest import load_script, read_metrics, run_script

ALGOS = ("dpo", "rloo", "ppo")


def verifier_flags(tiny, arithmetic_folder, *extra):
    # no reward model exists at --reward-model-path: the verifier must not load one
    return (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--reward",
        "verifier",
        "--reward-model-path",
        "./no/such/rm",
        "--dataset-path",
        str(arithmetic_folder),
        "--max-prompt-tokens",
        "256",
        "--response-length",
        "16",
        "--prompts-per-step",
        "8",
        "--num-samples-per-prompt",
        "4",
        "--temperature",
        "1.0",
        "--learning-rate",
        "3e-3",
        "--seed",
        "3",
        "--kv-cache-gib",
        "0.25",
        *extra,
    )


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.slow
def test_async_run_with_the_verifier_reward_trains_on_0_1_scores(algo, tiny, arithmetic_folder, tmp_path):
    proc, _ = run_script(
        f"async_{algo}.py",
        tmp_path,
        *verifier_flags(tiny, arithmetic_folder, "--num-learner-steps", "4", "--output-dir", str(tmp_path / "model")),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "7473 prompts, 0 dropped" in proc.stdout
    metrics = read_metrics(tmp_path)
    assert [m["async/actor_version"] for m in metrics] == [0, 0, 1, 2]
    for m in metrics:  # 0/1 rewards, no missing-EOS penalty: a mean score outside [0, 1] would be a reward model's
        assert 0.0 <= m["objective/scores"] <= 1.0
    if algo == "dpo":
        assert all(0.0 <= m["objective/tied_pairs"] <= 1.0 for m in metrics)
        assert all(
            m["objective/score_margin"] in (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0) for m in metrics
        )  # a mean of 8 margins, each 0 or 1
    assert (tmp_path / "model" / "config.json").exists()


@pytest.mark.slow
def test_the_evaluation_tool_grades_saved_policies_as_the_grpo_run_graded_them(tiny, arithmetic_folder, tmp_path):
    """A sync GRPO run evaluates its initial and its final policy in-run; tools/evaluate.py, given the same two
    folders afterwards, must find the same accuracies (same engine, same greedy decoding, same grader)."""
    flags = ("--dataset-path", str(arithmetic_folder), "--max-prompt-tokens", "128", "--response-length", "16")
    proc, _ = run_script(
        "sync_baselines/sync_grpo_gsm8k.py",
        tmp_path,
        "--model-name-or-path",
        str(tiny / "policy"),
        *flags,
        "--prompts-per-step",
        "4",
        "--num-learner-steps",
        "2",
        "--learning-rate",
        "3e-3",
        "--num-eval-prompts",
        "16",
        "--eval-every",
        "100",
        "--kv-cache-gib",
        "0.25",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "0",
        "--output-dir",
        str(tmp_path / "model"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    in_run = [json.loads(line) for line in next((tmp_path / "runs").glob("*/eval.jsonl")).read_text().splitlines()]
    assert [e["policy_version"] for e in in_run] == [0, 2]
    run_folder = next((tmp_path / "runs").iterdir())
    proc, _ = run_script(
        "tools/evaluate.py",
        tmp_path,
        str(tiny / "policy"),
        str(run_folder),
        str(tmp_path / "model"),
        *flags,
        "--num-eval-prompts",
        "16",
        "--kv-cache-gib",
        "0.25",
        "--output",
        str(tmp_path / "eval.jsonl"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    # the initial policy, the run's one snapshot (after step 1), the final model
    assert [r["policy"] for r in results] == [
        str(tiny / "policy"),
        str(run_folder / "checkpoint_1" / "policy"),
        str(tmp_path / "model"),
    ]
    assert all(r["num_problems"] == 16 for r in results)
    assert [results[0]["eval/accuracy"], results[2]["eval/accuracy"]] == [e["eval/accuracy"] for e in in_run]
    assert [results[0]["eval/format_rate"], results[2]["eval/format_rate"]] == [e["eval/format_rate"] for e in in_run]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(dataset_path="./no/such/folder"), "./no/such/folder/train.jsonl: no such file"),
        (dict(prompt_template="Q: {q}"), "--prompt-template must contain {question}"),
    ],
)
def test_bad_verifier_flags_are_rejected_naming_the_flag(algo, tiny, flags, message):
    module = load_script(f"async_{algo}.py")
    args = module.RunArgs(
        model_name_or_path=str(tiny / "policy"), reward="verifier", reward_model_path="./no/such/rm", **flags
    )
    with pytest.raises(SystemExit, match=re.escape(f"error: {message}")):
        module.check_args(args)
