"""`--reward verifier` in online DPO, RLOO and PPO: the paper's GSM8K setting, where an exact-match verifier replaces
the reward model. Real runs of the tiny policy on generated arithmetic problems (GSM8K format), on a real engine."""

import json
import re

import pytest

from conftest import load_script, read_metrics, run_script

ALGOS = ("dpo", "rloo", "ppo")


def verifier_flags(tiny, arithmetic_folder, *extra):
    # no reward model exists at --reward-model-path: the verifier must not load one
    return ("--model-name-or-path", str(tiny / "policy"), "--reward", "verifier", "--reward-model-path", "./no/such/rm",
            "--dataset-path", str(arithmetic_folder), "--max-prompt-tokens", "256", "--response-length", "16",
            "--prompts-per-step", "8", "--num-samples-per-prompt", "4", "--temperature", "1.0",
            "--learning-rate", "3e-3", "--seed", "3", "--num-eval-prompts", "8", "--eval-every", "2",
            "--kv-cache-gib", "0.25", *extra)


def evaluations(cwd):
    return [json.loads(line) for line in next((cwd / "runs").glob("*/eval.jsonl")).read_text().splitlines()]


@pytest.mark.parametrize("algo", ALGOS)
def test_async_run_with_the_verifier_reward_trains_and_evaluates(algo, tiny, arithmetic_folder, tmp_path):
    proc, _ = run_script(f"async_{algo}.py", tmp_path, *verifier_flags(tiny, arithmetic_folder, "--num-learner-steps",
                                                                        "4", "--output-dir", str(tmp_path / "model")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "7473 training problems" in proc.stdout and "8 held-out problems for greedy evaluation" in proc.stdout
    metrics = read_metrics(tmp_path)
    assert [m["async/actor_version"] for m in metrics] == [0, 0, 1, 2]
    for m in metrics:  # 0/1 rewards, no missing-EOS penalty: a mean score outside [0, 1] would be a reward model's
        assert 0.0 <= m["objective/scores"] <= 1.0 and 0.0 <= m["objective/format_rate"] <= 1.0
    if algo == "dpo":
        assert all(0.0 <= m["objective/tied_pairs"] <= 1.0 for m in metrics)
        assert all(m["objective/score_margin"] in (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
                   for m in metrics)  # a mean of 8 margins, each 0 or 1
    # every due version the generator held (0 and 2; K = 1 never loads 4) and the final one, greedy
    evals = evaluations(tmp_path)
    assert [e["policy_version"] for e in evals] == [0, 2, 4]
    assert all(0.0 <= e["eval/accuracy"] <= 1.0 for e in evals)
    assert "eval accuracy of policy version 4:" in proc.stdout
    assert (tmp_path / "model" / "config.json").exists()


def test_sync_run_with_the_verifier_reward_evaluates_every_due_version(tiny, arithmetic_folder, tmp_path):
    proc, _ = run_script("sync_baselines/sync_rloo.py", tmp_path,
                         *verifier_flags(tiny, arithmetic_folder, "--num-learner-steps", "3", "--output-dir",
                                         str(tmp_path / "model")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [e["policy_version"] for e in evaluations(tmp_path)] == [0, 2, 3]
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-4 for m in read_metrics(tmp_path))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("flags,message", [
    (dict(dataset_path="./no/such/folder"), "--dataset-path './no/such/folder' must be a folder holding train.jsonl"),
    (dict(prompt_template="Q: {q}"), "--prompt-template must contain {question}"),
    (dict(num_eval_prompts=-1), "--eval-every must be >= 1 and --num-eval-prompts >= 0"),
])
def test_bad_verifier_flags_are_rejected_naming_the_flag(algo, tiny, flags, message):
    module = load_script(f"async_{algo}.py")
    args = module.Args(model_name_or_path=str(tiny / "policy"), reward="verifier", reward_model_path="./no/such/rm",
                       **flags)
    with pytest.raises(SystemExit, match=re.escape(f"error: {message}")):
        module.check_args(args)
