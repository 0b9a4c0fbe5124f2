"""async_ppo.py and sync_baselines/sync_ppo.py: numerics vs hand computation, end-to-end runs, staleness, failures.

The end-to-end and bad-input subprocesses are started together (one module fixture) so that their vLLM/torch imports
and engine start-ups overlap; each is an ordinary run of the script on the tiny real models of conftest.py.
"""

import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import load_script, read_metrics, run_script

ASYNC, SYNC, MULTIGPU = "async_ppo.py", "sync_baselines/sync_ppo.py", "multigpu/async_ppo_multigpu.py"


@pytest.fixture(scope="module")
def ppo():
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
def test_gae_matches_a_hand_written_loop_on_padded_rows(ppo):
    # layout of token_logprobs: row 0 = 1 prompt column, 3 response tokens, 1 padding column;
    # row 1 = 2 prompt columns, 3 response tokens running to the last column (no padding)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float)
    rewards = torch.tensor([[0.0, -0.1, 0.2, 1.5, 0.0], [0.0, 0.0, 0.3, -0.2, -0.7]]) * mask
    values = torch.tensor([[9.0, 0.4, -0.3, 0.8, 9.0], [9.0, 9.0, 0.1, 0.5, -0.2]]) * mask  # as the learner masks them

    def hand_gae(r, v, gamma, lam):  # python floats, response tokens only; the episode ends after the last token
        adv, last = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            next_v = v[t + 1] if t + 1 < len(r) else 0.0
            last = r[t] + gamma * next_v - v[t] + gamma * lam * last
            adv[t] = last
        return adv

    for gamma, lam in ((1.0, 0.95), (0.9, 0.5)):
        adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam)
        for row, cols in ((0, [1, 2, 3]), (1, [2, 3, 4])):
            r, v = [rewards[row, c].item() for c in cols], [values[row, c].item() for c in cols]
            expected = hand_gae(r, v, gamma, lam)
            assert adv[row, cols].tolist() == pytest.approx(expected, abs=1e-6)
            assert ret[row, cols].tolist() == pytest.approx([a + b for a, b in zip(expected, v)], abs=1e-6)
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    # gamma 1, lambda .95, row 0: A3 = 1.5 - .8 = .7; A2 = .2 + .8 + .3 + .95 * .7 = 1.965;
    # A1 = -.1 - .3 - .4 + .95 * 1.965
    adv, _ = ppo.compute_gae(rewards, values, mask, 1.0, 0.95)
    assert adv[0, 1:4].tolist() == pytest.approx([1.06675, 1.965, 0.7], abs=1e-6)


def test_masked_whiten_uses_only_response_tokens(ppo):
    x = torch.tensor([[100.0, 1.0, 2.0, 4.0], [-50.0, -50.0, 3.0, 5.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.float)
    kept = [1.0, 2.0, 4.0, 3.0, 5.0]  # mean 3, unbiased variance (4 + 1 + 1 + 0 + 4) / 4 = 2.5
    mean, std = statistics.mean(kept), statistics.stdev(kept)
    assert (mean, std**2) == pytest.approx((3.0, 2.5))
    white = ppo.masked_whiten(x, mask)
    expected = [
        [0.0] + [(v - mean) / math.sqrt(std**2 + 1e-8) for v in (1.0, 2.0, 4.0)],
        [0.0, 0.0] + [(v - mean) / math.sqrt(std**2 + 1e-8) for v in (3.0, 5.0)],
    ]
    assert white.tolist()[0] == pytest.approx(expected[0], abs=1e-6)
    assert white.tolist()[1] == pytest.approx(expected[1], abs=1e-6)
    assert ppo.masked_whiten(torch.tensor([[3.0]]), torch.ones(1, 1)).tolist() == [[0.0]]  # one token: 0, not NaN


def test_per_token_rewards_put_the_score_on_the_last_response_token(ppo):
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float)
    logprobs = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-0.5, -0.5, -0.5, -0.5]])
    ref = torch.tensor([[-9.0, -1.5, -1.0, -9.0], [-0.5, -1.5, 0.5, -0.5]])
    rewards, kl = ppo.per_token_rewards(torch.tensor([2.0, -1.0]), logprobs, ref, mask, kl_coef=0.1)
    # kl = (log pi - log pi_ref) on the mask: row 0 (0.5, -1.0), row 1 (0, 1, -1, 0); reward = -0.1 * kl (+ score)
    assert kl.flatten().tolist() == pytest.approx([0, 0.5, -1.0, 0] + [0, 1.0, -1.0, 0])
    assert rewards.flatten().tolist() == pytest.approx([0, -0.05, 0.1 + 2.0, 0] + [0, -0.1, 0.1, 0 - 1.0])


def test_clipped_value_loss_matches_hand_computation(ppo):
    # cliprange_value 0.2; (new V, old V, return) ->
    #   (0.5, 0.4, 1.0): inside the clip range, both terms (0.5 - 1)^2 = 0.25
    #   (1.0, 0.5, 0.0): clipped V 0.7; max((1.0)^2, (0.7)^2) = 1.0   the unclipped term wins
    #   (1.0, 0.5, 2.0): clipped V 0.7; max((1.0)^2, (1.3)^2) = 1.69  the clipped term wins (no gradient)
    #   (5.0, 0.0, -5.0): masked out
    # loss = 0.5 * (0.25 + 1.0 + 1.69) / 3 = 0.49; clipfrac = 1/3
    new = torch.tensor([[0.5, 1.0, 1.0, 5.0]], requires_grad=True)
    old, returns = torch.tensor([[0.4, 0.5, 0.5, 0.0]]), torch.tensor([[1.0, 0.0, 2.0, -5.0]])
    loss, clipfrac = ppo.clipped_value_loss(new, old, returns, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 0.2)
    assert loss.item() == pytest.approx(0.49, abs=1e-6) and clipfrac == pytest.approx(1 / 3)
    loss.backward()  # 0.5 * 2 * (V - R) / 3 on the unclipped winners: (0.5 - 1) / 3, (1 - 0) / 3
    assert new.grad[0].tolist() == pytest.approx([-1 / 6, 1 / 3, 0, 0], abs=1e-6)


def test_behaviour_logprobs_land_in_the_learner_layout(ppo):
    ids, attn, resp = ppo.pad_sequences([[1, 2], [3]], [[4], [6, 7, 8]], 0, "cpu")  # row 0: [1, 2, 4, pad]
    # column t is token t + 1: row 0's response token 4 sits in column 1
    out = ppo.behaviour_logprobs_tensor([[-0.1], [-0.3, -0.4, -0.5]], resp)
    assert out.flatten().tolist() == pytest.approx([0, -0.1, 0] + [-0.3, -0.4, -0.5])


def test_values_are_the_score_head_on_every_prefix(ppo, tiny):
    from transformers import AutoModelForSequenceClassification

    vm = AutoModelForSequenceClassification.from_pretrained(tiny / "rm", num_labels=1).eval()
    ids, attn, _ = ppo.pad_sequences([[5, 6, 7], [5, 6]], [[9, 10], [9]], 0, "cpu")  # row 1 is right-padded
    with torch.no_grad():
        values = ppo.get_values(vm, ids, attn)
    for row, length in ((0, 5), (1, 3)):
        for t in range(length - 1):  # column t = value of tokens[: t + 1], the state that samples token t + 1
            prefix = ids[row : row + 1, : t + 1]
            assert values[row, t].item() == pytest.approx(
                ppo.get_scores(vm, prefix, torch.ones_like(prefix), 8).item(), abs=1e-5
            )


# ---------------------------------------------------------------- subprocess runs, started together
# each a run from the warm launcher; the other checks are covered in-process by
# test_check_args_names_the_flag
BAD_INPUTS = [
    (ASYNC, ("--model-name-or-path", "./no/such/model"), "--model-name-or-path './no/such/model': no such folder"),
    (SYNC, ("--max-prompt-tokens", "2"), "all 64 prompts are empty or longer than --max-prompt-tokens 2"),
    (ASYNC, ("--async-steps", "-1"), "--async-steps must be >= 0, got -1"),
]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """K=1 (ratio to vLLM's logprobs) and K=2 (decoupled, two micro-batches) async runs (5 steps), the K=2 run again on
    the multigpu variant, a sync run with N=2 and the paper's loss (4 steps), and the bad-input runs, all in parallel."""
    k2 = (
        "--num-learner-steps",
        "5",
        "--async-steps",
        "2",
        "--off-policy-correction",
        "decoupled",
        "--micro-batch-size",
        "4",
    )
    jobs = {
        "k1": (ASYNC, ("--num-learner-steps", "5", "--async-steps", "1", "--off-policy-correction", "behaviour")),
        "k2": (ASYNC, k2),
        "k2_multigpu": (MULTIGPU, k2),
        "sync": (SYNC, ("--num-learner-steps", "4", "--num-mini-batches", "2")),
    }
    jobs.update(
        {f"bad{i}": (script, ("--num-learner-steps", "2", *flags)) for i, (script, flags, _) in enumerate(BAD_INPUTS)}
    )
    with ThreadPoolExecutor(len(jobs)) as pool:
        started = {}
        for name, (script, flags) in jobs.items():
            cwd = tmp_path_factory.mktemp(name)
            flags = (*common_flags(tiny, *flags), "--output-dir", str(cwd / "model"))
            started[name] = cwd, pool.submit(run_script, script, cwd, *flags, timeout=1800)
    results = {}
    for name, (cwd, future) in started.items():
        proc, _ = future.result()
        results[name] = (cwd, proc.returncode, proc.stdout, proc.stderr)
    return results


def metrics_of(runs, name):
    cwd, returncode, _, stderr = runs[name]
    assert returncode == 0, stderr[-4000:]
    return read_metrics(cwd)


@pytest.mark.slow
def test_async_run_writes_metrics_and_a_loadable_model(runs, tiny):
    from transformers import AutoModelForCausalLM

    metrics = metrics_of(runs, "k1")
    cwd, _, stdout, _ = runs["k1"]
    assert [m["step"] for m in metrics] == list(range(5))
    for key in (
        "objective/scores",
        "objective/kl",
        "objective/rlhf_reward",
        "objective/non_score_reward",
        "losses/policy_loss",
        "losses/value_loss",
        "value/clipfrac",
        "policy/entropy",
        "policy/approx_kl",
        "policy/clipfrac",
        "policy/importance_ratio_mean",
        "policy/importance_ratio_max",
        "val/eos_rate",
        "policy/zero_gradient_frac",
        "policy/importance_weight_mean",
        "time/generation",
        "time/training",
        "time/weight_sync",
        "time/learner_waiting",
        "async/actor_version",
        "async/staleness",
        "async/behaviour_learner_logprob_gap",
    ):
        assert all(math.isfinite(m[key]) for m in metrics), key
    for m in metrics:  # rlhf reward = score - kl_coef * KL, per sequence, averaged
        assert m["objective/non_score_reward"] == pytest.approx(-0.05 * m["objective/kl"], abs=1e-5)
        assert m["objective/rlhf_reward"] == pytest.approx(
            m["objective/scores"] + m["objective/non_score_reward"], abs=1e-5
        )
    assert list((cwd / "runs").glob("*/events.out.tfevents.*")), "no tensorboard file"
    assert "60 prompts, 4 dropped as longer than --max-prompt-tokens 64" in stdout
    trained = AutoModelForCausalLM.from_pretrained(cwd / "model")
    initial = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    assert any(m["losses/value_loss"] > 0 for m in metrics) and len({m["losses/policy_loss"] for m in metrics}) > 1


@pytest.mark.parametrize("name,k", [("k1", 1), ("k2", 2)])
@pytest.mark.slow
def test_async_batches_come_from_exactly_version_step_minus_k(runs, name, k):
    metrics = metrics_of(runs, name)
    assert [m["async/actor_version"] for m in metrics] == [max(0, m["step"] - k) for m in metrics]
    assert [m["async/staleness"] for m in metrics] == [min(m["step"], k) for m in metrics]
    # at step 0 the learner and the engine hold the same (initial) weights; later the engine's are K versions old
    assert metrics[0]["async/behaviour_learner_logprob_gap"] < 1e-4
    assert metrics[-1]["async/behaviour_learner_logprob_gap"] > 1e-3
    assert abs(metrics[0]["objective/kl"]) < 1e-3 and abs(metrics[-1]["objective/kl"]) > 1e-2
    # on-policy, step 0 measures ~1e-10: vLLM and learner logprobs agree to float noise
    assert metrics[0]["policy/approx_kl"] < 1e-6


@pytest.mark.slow
def test_behaviour_mode_ratio_and_kl_are_those_of_the_policy_that_sampled(runs):
    metrics = metrics_of(runs, "k1")
    # batches 0..K come from version 0 = the reference, so their KL (with vLLM's log pi) is 0
    assert all(abs(m["objective/kl"]) < 1e-3 for m in metrics[:2])
    # stale samples: the first (only) update of step i > 0 already sees ratios != 1; no importance weight
    assert metrics[-1]["policy/approx_kl"] > 1e-3 and metrics[-1]["policy/importance_ratio_max"] > 1.05
    assert all(m["policy/importance_weight_mean"] == 1.0 for m in metrics)


@pytest.mark.parametrize("name", ["k2", "k2_multigpu"])
@pytest.mark.slow
def test_decoupled_mode_clips_around_the_learner_and_weights_by_the_staleness(runs, name):
    metrics = metrics_of(runs, name)
    # two micro-batches: the core takes pi_old of both from no-grad passes, the multigpu variant that of the first from
    # its training forward and that of the second from a no-grad pass; the first update's ratio is 1 only if the
    # no-grad passes give every row of the loop what its training forward computes, at the row's place
    assert "micro-batch 4 of 8 sequences" in runs[name][2]
    for m in metrics:  # N = 1: the only update is the first, where pi = pi_old bit for bit
        assert m["policy/importance_ratio_max"] == 1.0 and m["policy/approx_kl"] == 0.0  # no token's ratio below 1
        assert m["policy/clipfrac"] == 0.0 and m["policy/zero_gradient_frac"] == 0.0
    # the truncated weight pi_old / mu: 1 while the learner still holds the sampling version, not once it moved on
    assert metrics[0]["policy/importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert abs(metrics[-1]["policy/importance_weight_mean"] - 1.0) > 1e-3
    assert all(m["policy/importance_weight_mean"] <= 2.0 for m in metrics)
    # the KL penalty's log pi is the learner's recomputation, which has moved away from version 0 by step 1
    assert abs(metrics[1]["objective/kl"]) > 1e-3


@pytest.mark.slow
def test_sync_baseline_generates_every_batch_with_the_current_policy(runs):
    metrics = metrics_of(runs, "sync")
    assert [m["async/actor_version"] for m in metrics] == [0, 1, 2, 3]
    assert all(m["async/staleness"] == 0 for m in metrics)
    # the engine really runs the learner's current weights at every step (the weights do change: lr 3e-3)
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-4 for m in metrics)
    assert abs(metrics[-1]["objective/kl"]) > 1e-2
    # N = 2: the second mini-batch is off-policy by one update, so ratios move away from 1 within every step
    assert all(m["policy/approx_kl"] > 1e-4 for m in metrics)  # measured >= 5e-3; fully on-policy gives ~1e-10
    assert all(m["policy/importance_weight_mean"] == 1.0 for m in metrics)  # paper mode: no importance weight
    assert (runs["sync"][0] / "model" / "config.json").exists()
    # the trained critic is saved beside the policy and loads as a one-label sequence classifier
    from transformers import AutoModelForSequenceClassification

    critic = AutoModelForSequenceClassification.from_pretrained(runs["sync"][0] / "model" / "value_model")
    assert critic.config.num_labels == 1


@pytest.mark.parametrize("index", range(len(BAD_INPUTS)), ids=[" ".join(flags) for _, flags, _ in BAD_INPUTS])
@pytest.mark.slow
def test_bad_input_fails_with_one_message_before_the_engine_starts(runs, index):
    _, returncode, stdout, stderr = runs[f"bad{index}"]
    assert returncode != 0
    assert f"error: {BAD_INPUTS[index][2]}" in stderr
    assert "Traceback" not in stderr
    assert "Initializing a V1 LLM engine" not in stderr + stdout


@pytest.mark.parametrize("script", [ASYNC, SYNC])
@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(num_samples_per_prompt=0), "--num-samples-per-prompt and --num-ppo-epochs must be >= 1"),
        (dict(micro_batch_size=0), "--micro-batch-size must be >= 1"),
        (dict(micro_batch_memory_gib=0.0), "--micro-batch-memory-gib > 0"),
        (dict(kl_coef=-0.1), "--kl-coef must be >= 0"),
        (dict(prompts_per_step=6, num_mini_batches=4), "--prompts-per-step 6 is not divisible by --num-mini-batches 4"),
    ],
)
def test_check_args_names_the_flag(tiny, script, overrides, message):
    module = load_script(script)
    args = module.RunArgs(
        model_name_or_path=str(tiny / "policy"),
        reward_model_path=str(tiny / "rm"),
        dataset_name=str(tiny / "prompts.jsonl"),
        **overrides,
    )
    with pytest.raises(SystemExit, match=message.replace("+", r"\+")):
        module.check_args(args)
