"""async_rloo.py and sync_baselines/sync_rloo.py: numerics, end-to-end runs on a real engine, bad input."""

import math
import re
from pathlib import Path

import pytest
import torch

from conftest import load_script, read_metrics, run_script

ASYNC, SYNC, MULTIGPU = "async_rloo.py", "sync_baselines/sync_rloo.py", "multigpu/async_rloo_multigpu.py"


@pytest.fixture(scope="module")
def rloo():
    return load_script(ASYNC)


def common_flags(tiny: Path, *extra: str):
    return (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--reward-model-path",
        str(tiny / "rm"),
        "--dataset-name",
        str(tiny / "prompts.jsonl"),
        "--max-prompt-tokens",
        "64",
        "--response-length",
        "16",
        "--prompts-per-step",
        "4",
        "--num-samples-per-prompt",
        "2",
        "--learning-rate",
        "3e-3",
        "--seed",
        "3",
        "--sample-every",
        "2",
        *extra,
    )


# ---------------------------------------------------------------- pure helpers
def test_rloo_advantages_match_hand_computation(rloo):
    # prompt 1 (k=3) rewards 1, 2, 6: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> A = -3, -1.5, 4.5
    # prompt 2: all equal rewards -> every baseline equals the reward -> A = 0
    advantages = rloo.rloo_advantages(torch.tensor([1.0, 2.0, 6.0, 0.7, 0.7, 0.7]), k=3)
    assert advantages.tolist() == pytest.approx([-3.0, -1.5, 4.5, 0.0, 0.0, 0.0], abs=1e-6)
    # k=2: each sample's baseline is the other one -> A = +-(r1 - r2); samples of a prompt are adjacent
    advantages = rloo.rloo_advantages(torch.tensor([0.5, -0.25, 3.0, 1.0]), k=2)
    assert advantages.tolist() == pytest.approx([0.75, -0.75, 2.0, -2.0], abs=1e-6)
    # the leave-one-out advantages of a prompt always sum to 0: sum_i r_i - sum_i (S - r_i)/(k-1) = S - S
    random_rewards = torch.randn(5 * 4)
    assert rloo.rloo_advantages(random_rewards, k=4).view(5, 4).sum(1).abs().max() < 1e-5


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def async_runs(tiny, tmp_path_factory):
    """A K=1 run with N=2 mini-batches and the ratio to vLLM's logprobs, and a K=2 run with N=1, two micro-batches
    and the paper's loss (the default), each 5 learner steps; and the K=2 run again on the multigpu variant."""
    runs = {}
    for name, script, k, n, correction in (
        ("k1", ASYNC, 1, 2, "behaviour"),
        ("k2", ASYNC, 2, 1, "paper"),
        ("k2_multigpu", MULTIGPU, 2, 1, "paper"),
    ):
        cwd = tmp_path_factory.mktemp(name)
        micro_batches = ("--micro-batch-size", "4") if k == 2 else ()  # K=2: the variant's shortcut takes one of two
        proc, _ = run_script(
            script,
            cwd,
            *common_flags(
                tiny,
                "--num-learner-steps",
                "5",
                "--async-steps",
                str(k),
                "--num-mini-batches",
                str(n),
                "--off-policy-correction",
                correction,
                *micro_batches,
                "--output-dir",
                str(cwd / "model"),
            ),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = (cwd, proc, read_metrics(cwd))
    return runs


KEYS = (
    "objective/scores",
    "objective/kl",
    "objective/rlhf_reward",
    "losses/policy_loss",
    "policy/importance_ratio_mean",
    "policy/importance_ratio_max",
    "policy/clipfrac",
    "policy/approx_kl",
    "policy/zero_gradient_frac",
    "policy/importance_weight_mean",
    "policy/grad_norm",
    "policy/learning_rate",
    "val/eos_rate",
    "val/response_length",
    "time/generation",
    "time/reward_labeling",
    "time/training",
    "time/weight_sync",
    "time/learner_waiting",
    "time/actor_waiting",
    "async/actor_version",
    "async/staleness",
    "async/behaviour_learner_logprob_gap",
)


@pytest.mark.slow
def test_async_run_writes_metrics_and_a_loadable_model(async_runs, tiny):
    from transformers import AutoModelForCausalLM

    cwd, proc, metrics = async_runs["k1"]
    assert [m["step"] for m in metrics] == list(range(5))
    for key in KEYS:
        assert all(math.isfinite(m[key]) for m in metrics), key
    assert list((cwd / "runs").glob("*/events.out.tfevents.*")), "no tensorboard file"
    assert "60 prompts, 4 dropped as longer than --max-prompt-tokens 64" in proc.stdout
    trained = AutoModelForCausalLM.from_pretrained(cwd / "model")
    initial = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    assert metrics[-1]["episodes"] == 5 * 4 * 2


@pytest.mark.slow
def test_reward_is_score_minus_the_kl_penalty_of_the_anchor_policy(async_runs):
    for name, k in (("k1", 1), ("k2", 2)):
        metrics = async_runs[name][2]
        for m in metrics:  # means are linear: mean(r) = mean(score) - 0.05 * mean(KL)
            assert m["objective/rlhf_reward"] == pytest.approx(
                m["objective/scores"] - 0.05 * m["objective/kl"], abs=1e-4
            )
        assert abs(metrics[0]["objective/kl"]) < 1e-3  # version 0 is the reference itself
        assert abs(metrics[-1]["objective/kl"]) > 1e-2
    # behaviour mode: the log pi of the KL is vLLM's, and the first K + 1 batches were sampled by version 0
    assert all(abs(m["objective/kl"]) < 1e-3 for m in async_runs["k1"][2][:2])
    # paper mode: it is the learner's own recomputation, which has moved on from version 0 by step 1
    assert abs(async_runs["k2"][2][1]["objective/kl"]) > 1e-3


@pytest.mark.parametrize("name,k", [("k1", 1), ("k2", 2)])
@pytest.mark.slow
def test_async_batches_come_from_exactly_version_step_minus_k(async_runs, name, k):
    metrics = async_runs[name][2]
    assert [m["async/actor_version"] for m in metrics] == [max(0, m["step"] - k) for m in metrics]
    assert [m["async/staleness"] for m in metrics] == [min(m["step"], k) for m in metrics]
    # at step 0 the learner and the engine hold the same (initial) weights; later the engine's are K versions old
    assert metrics[0]["async/behaviour_learner_logprob_gap"] < 1e-4
    assert metrics[-1]["async/behaviour_learner_logprob_gap"] > 1e-3


@pytest.mark.slow
def test_behaviour_mode_takes_the_ratio_to_the_policy_that_sampled(async_runs):
    metrics = async_runs["k1"][2]  # (on-policy the ratio is 1: see the sync test, which runs in behaviour mode)
    # later batches are a version old (lr 3e-3 moves the tiny policy a lot): the ratio is far from 1
    assert metrics[-1]["policy/approx_kl"] > 1e-3 and metrics[-1]["policy/clipfrac"] > 0.0
    assert all(m["policy/importance_weight_mean"] == 1.0 for m in metrics)


@pytest.mark.slow
def test_paper_mode_ratio_is_exactly_one_at_the_first_update_however_stale(async_runs):
    metrics = async_runs["k2"][2]  # N=1: each step's only update is its first
    # pi_old from a no-grad pass, pi from the update's forwards, both in two micro-batches: the ratio is 1 only if the
    # no-grad pass gives every row of the loop what its training forward computes, at the row's place
    assert "micro-batch 4 of 8 sequences" in async_runs["k2"][1].stdout
    assert metrics[-1]["async/staleness"] == 2 and metrics[-1]["async/behaviour_learner_logprob_gap"] > 1e-3
    for m in metrics:  # recomputed in the very micro-batches of the update: equal bit for bit
        assert m["policy/importance_ratio_max"] == 1.0 and m["policy/importance_ratio_mean"] == 1.0
        assert m["policy/approx_kl"] == 0.0  # the sequences' log-ratios are 0, not merely rounded away by exp
        assert m["policy/clipfrac"] == 0.0 and m["policy/zero_gradient_frac"] == 0.0


@pytest.mark.slow
def test_the_multigpu_variant_s_shortcut_trains_exactly_as_the_core(async_runs):
    """multigpu/async_rloo_multigpu.py takes pi_old of the first micro-batch from its training forward, the core from a
    no-grad pass over every row (in the loop's micro-batches: bit for bit the same): as one process, with the same flags
    and seed, the variant logs every number the core logs and trains the same weights."""
    from transformers import AutoModelForCausalLM

    (core_dir, _, core), (variant_dir, _, variant) = async_runs["k2"], async_runs["k2_multigpu"]
    assert len(core) == len(variant) == 5
    for c, v in zip(core, variant):
        assert {key: c[key] for key in c if not key.startswith("time/")} == {
            key: v[key] for key in c if not key.startswith("time/")
        }
    weights = [AutoModelForCausalLM.from_pretrained(d / "model").state_dict() for d in (core_dir, variant_dir)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


@pytest.mark.slow
def test_decoupled_mode_weights_each_token_of_stale_steps_only(tiny, tmp_path):
    """--off-policy-correction decoupled at K = 2: the weights min(pi_old / mu, cap) are per token; at step 0 the engine
    and the learner hold the same weights, so they are all 1 up to the float gap; later they spread, within the cap.
    Their effective sample size and the logprob gap are the whole batch's: one sequence per micro-batch logs what the
    whole mini-batch at once logs (a mean of per-micro-batch values, as before, would not)."""
    metrics = {}
    for micro_batch_size in ("1", "4"):  # 4: the whole mini-batch (8 sequences in N = 2)
        cwd = tmp_path / f"m{micro_batch_size}"
        cwd.mkdir()
        proc, _ = run_script(
            ASYNC,
            cwd,
            *common_flags(
                tiny,
                "--num-learner-steps",
                "4",
                "--async-steps",
                "2",
                "--num-mini-batches",
                "2",
                "--off-policy-correction",
                "decoupled",
                "--importance-weight-cap",
                "1.5",
                "--micro-batch-size",
                micro_batch_size,
            ),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        metrics[micro_batch_size] = read_metrics(cwd)
    metrics, one = metrics["4"], metrics["1"]
    assert metrics[0]["policy/importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics[0]["policy/importance_weight_ess"] == pytest.approx(1.0, abs=1e-6)
    for m in metrics[1:]:  # a version or two stale: the tokens' weights differ, none above the cap
        assert m["policy/importance_weight_ess"] < 1.0 and m["policy/importance_weight_mean"] <= 1.5
        assert math.isfinite(m["losses/policy_loss"]) and math.isfinite(m["policy/grad_norm"])
    # the same samples (steps 0-2 from version 0, step 3 from a version 1 equal to rounding): the same numbers
    for key in ("policy/importance_weight_ess", "async/behaviour_learner_logprob_gap"):
        assert [m[key] for m in one] == pytest.approx([m[key] for m in metrics], rel=1e-4, abs=1e-9), key
    assert metrics[-1]["async/behaviour_learner_logprob_gap"] > 1e-3


@pytest.mark.slow
def test_sync_baseline_generates_every_batch_with_the_current_policy(tiny, tmp_path):
    # N=1 and fresh weights every step: the data is on-policy, so even vLLM's logprobs give a ratio of 1
    proc, _ = run_script(
        SYNC,
        tmp_path,
        *common_flags(
            tiny,
            "--num-learner-steps",
            "4",
            "--off-policy-correction",
            "behaviour",
            "--output-dir",
            str(tmp_path / "model"),
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(tmp_path)
    for key in KEYS:
        assert all(math.isfinite(m[key]) for m in metrics), key
    assert [m["async/actor_version"] for m in metrics] == [0, 1, 2, 3]
    assert all(m["async/staleness"] == 0 for m in metrics)
    # the engine really runs the learner's current weights at every step (the weights do change: lr 3e-3)
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-4 for m in metrics)
    assert all(m["policy/importance_ratio_max"] == pytest.approx(1.0, abs=1e-3) for m in metrics)
    assert abs(metrics[-1]["objective/kl"]) > 1e-2
    assert (tmp_path / "model" / "config.json").exists()


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(prompts_per_step=5, num_mini_batches=2), "--prompts-per-step 5 is not divisible by --num-mini-batches 2"),
        (dict(num_samples_per_prompt=1), "--num-samples-per-prompt must be >= 2 for a leave-one-out baseline, got 1"),
        (dict(cliprange=-0.1), "--cliprange must be >= 0, got -0.1"),
    ],
)
def test_bad_flag_values_are_rejected_with_a_message_naming_the_flag(rloo, tiny, flags, message):
    # `check_args` is the same function in both files (checked above); the subprocess test below shows it runs first
    args = rloo.RunArgs(
        model_name_or_path=str(tiny / "policy"),
        reward_model_path=str(tiny / "rm"),
        dataset_name=str(tiny / "prompts.jsonl"),
        **flags,
    )
    with pytest.raises(SystemExit, match=re.escape(f"error: {message}")):
        rloo.check_args(args)


@pytest.mark.parametrize(
    "script,flags,message",
    [
        (
            ASYNC,
            ("--num-samples-per-prompt", "1"),
            "--num-samples-per-prompt must be >= 2 for a leave-one-out baseline",
        ),
        (
            SYNC,
            ("--prompts-per-step", "5", "--num-mini-batches", "2"),
            "--prompts-per-step 5 is not divisible by --num-mini-batches 2",
        ),
    ],
)
def test_bad_input_fails_with_one_message_before_the_engine_starts(tiny, tmp_path, cli, script, flags, message):
    proc = cli(script, tmp_path, *common_flags(tiny, "--num-learner-steps", "2"), *flags)
    assert proc.returncode != 0
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Initializing a V1 LLM engine" not in proc.stderr + proc.stdout
