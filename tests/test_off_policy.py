"""`--off-policy-correction` (paper, behaviour, decoupled) in RLOO, PPO and GRPO: each loss on a hand-computed stale
example, the three modes equal on-policy, and the flag's checks. The end-to-end runs (the paper ratio is exactly 1 at
the first update of a stale step) are in each algorithm's test file."""

import re

import pytest
import torch

from conftest import load_script

SCRIPTS = ("async_rloo.py", "async_ppo.py", "async_grpo_gsm8k.py")


@pytest.fixture(scope="module", params=SCRIPTS)
def script(request):
    return load_script(request.param)


def policy_loss(module, new, anchor, weights, advantages, dual_clip=None):
    """Each script's loss on four terms: RLOO's are sequences, PPO's and GRPO's four one-token responses."""
    if hasattr(module, "rloo_advantages"):
        return module.clipped_policy_loss(new, anchor, weights, advantages, 0.2, dual_clip)
    column = (lambda x: x[:, None])
    mask = torch.ones(4, 1)
    if hasattr(module, "compute_gae"):  # PPO: per-token advantages
        return module.clipped_policy_loss(column(new), column(anchor), column(weights), column(advantages), mask, 0.2,
                                          dual_clip)
    return module.grpo_policy_loss(column(new), column(anchor), column(weights), advantages, mask, 0.2, dual_clip)


def stale_example():
    """Four terms, cliprange 0.2, cap 2. Logprobs relative to the behaviour policy mu (vLLM's, version i-K):
        term  A      pi_old/mu  pi/pi_old  pi/mu
        1     +1     1.5        1.0        1.5
        2     -1     4.0        1.1        4.4
        3     +2     0.5        1.3        0.65
        4     -0.5   1.0        0.7        0.7
    """
    behaviour = torch.tensor([-3.0, -9.0, -1.0, -6.0])
    old = behaviour + torch.tensor([1.5, 4.0, 0.5, 1.0]).log()
    new = (old + torch.tensor([1.0, 1.1, 1.3, 0.7]).log()).requires_grad_(True)
    return new, old, behaviour, torch.tensor([1.0, -1.0, 2.0, -0.5])


# Per mode: loss, d loss / d log pi, zero-gradient fraction, clip fraction, mean importance weight.
# paper: r = 1.0, 1.1, 1.3, 0.7; max(-A r, -A clip(r)) = max(-1, -1), max(1.1, 1.1), max(-2.6, -2.4), max(0.35, 0.4)
#   = -1, 1.1, -2.4 (clipped), 0.4 (clipped): loss -1.9 / 4; gradient -A r / 4 where not clipped: -0.25, 0.275
# behaviour: r = 1.5, 4.4, 0.65, 0.7: max(-1.5, -1.2), max(4.4, 1.2), max(-1.3, -1.6), max(0.35, 0.4)
#   = -1.2 (clipped), 4.4, -1.3, 0.4 (clipped): loss 2.3 / 4; gradient 4.4 / 4, -1.3 / 4
# decoupled: paper's terms times min(pi_old/mu, 2) = 1.5, 2, 0.5, 1: -1.5, 2.2, -1.2, 0.4: loss -0.1 / 4;
#   gradient 1.5 * -1 / 4, 2 * 1.1 / 4
EXPECTED = {
    "paper": (-0.475, [-0.25, 0.275, 0.0, 0.0], 0.5, 0.5, 1.0),
    "behaviour": (0.575, [0.0, 1.1, -0.325, 0.0], 0.5, 1.0, 1.0),
    "decoupled": (-0.025, [-0.375, 0.55, 0.0, 0.0], 0.5, 0.5, 1.25),
}


@pytest.mark.parametrize("mode", EXPECTED)
def test_each_mode_on_a_hand_computed_stale_example(script, mode):
    new, old, behaviour, advantages = stale_example()
    anchor, weights = script.off_policy_anchor(mode, None if mode == "behaviour" else old, behaviour, 2.0)
    loss, stats = policy_loss(script, new, anchor, weights, advantages)
    loss.backward()
    expected_loss, expected_grad, zero_gradient_frac, clipfrac, weight_mean = EXPECTED[mode]
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert new.grad.flatten().tolist() == pytest.approx(expected_grad, abs=1e-5)
    assert stats["zero_gradient_frac"] == pytest.approx(zero_gradient_frac)
    assert stats["clipfrac"] == pytest.approx(clipfrac)
    assert stats["importance_weight_mean"] == pytest.approx(weight_mean)


def test_the_dual_clip_bounds_a_negative_advantage_and_cuts_its_gradient(script):
    new, _, behaviour, advantages = stale_example()
    anchor, weights = script.off_policy_anchor("behaviour", None, behaviour, 2.0)
    loss, stats = policy_loss(script, new, anchor, weights, advantages, dual_clip=3.0)
    loss.backward()
    # term 2 (A = -1, r = 4.4 > 3) now loses -A * 3 = 3 instead of 4.4, with no gradient: (-1.2 + 3 - 1.3 + 0.4) / 4
    assert loss.item() == pytest.approx(0.225, abs=1e-5)
    assert new.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.325, 0.0], abs=1e-5)
    assert stats["zero_gradient_frac"] == pytest.approx(0.75)


def test_on_policy_the_three_modes_give_the_same_loss_and_gradient(script):
    # K = 0, N = 1: the learner's recomputation, vLLM's logprobs and the policy being trained all agree
    torch.manual_seed(0)
    logprobs, advantages = -torch.rand(4) * 5, torch.randn(4)
    results = []
    for mode in EXPECTED:
        new = logprobs.clone().requires_grad_(True)
        anchor, weights = script.off_policy_anchor(mode, None if mode == "behaviour" else logprobs, logprobs, 2.0)
        loss, stats = policy_loss(script, new, anchor, weights, advantages)
        loss.backward()
        assert stats["importance_ratio_max"] == 1.0 and stats["importance_weight_mean"] == 1.0
        assert stats["zero_gradient_frac"] == 0.0
        results.append((loss.item(), new.grad.tolist()))
    assert results[0] == results[1] == results[2]
    assert results[0][0] == pytest.approx(-advantages.mean().item(), abs=1e-6)  # ratio 1: plain policy gradient


@pytest.mark.parametrize("mode", EXPECTED)
def test_the_anchor_and_the_weights_never_carry_gradient(script, mode):
    """A caller that forgets to detach (the anchor from a forward pass with gradient) must not train through it."""
    old, behaviour = (-torch.rand(4)).requires_grad_(True), (-torch.rand(4)).requires_grad_(True)
    anchor, weights = script.off_policy_anchor(mode, None if mode == "behaviour" else old, behaviour, 2.0)
    assert not anchor.requires_grad and not weights.requires_grad


def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient():
    # RLOO sums ~50 token log-ratios, which can pass 88 where exp overflows float32
    rloo = load_script("async_rloo.py")
    new = torch.tensor([-1.0, -1.0], requires_grad=True)
    for dual_clip, expected in ((3.0, (3.0 - 1.2) / 2), (None, None)):
        anchor, weights = rloo.off_policy_anchor("decoupled", torch.tensor([-101.0, -101.0]),
                                                 torch.tensor([-300.0, -300.0]), 2.0)
        loss, _ = rloo.clipped_policy_loss(new, anchor, weights, torch.tensor([-1.0, 1.0]), 0.2, dual_clip)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(new.grad).all() and weights.tolist() == [2.0, 2.0]
        if expected is not None:
            assert loss.item() == pytest.approx(2.0 * expected)  # both terms weighted 2
        new.grad = None


@pytest.mark.parametrize("flags,message", [
    (["--off-policy-correction", "tis"], None),
    (["--importance-weight-cap", "0.5"], "--importance-weight-cap must be >= 1 (a cap below 1 down-weights on-policy "
                                         "samples), got 0.5"),
    (["--dual-clip", "1.0"], "--dual-clip must be > 1 + --cliprange = 1.2 (or None), got 1.0"),
    (["--dual-clip", "1.1"], "--dual-clip must be > 1 + --cliprange = 1.2 (or None), got 1.1"),  # inside the clip
])
def test_bad_correction_flags_are_rejected(script, flags, message):
    import tyro

    if message is None:  # not one of the choices: tyro names the flag and the choices
        with pytest.raises(SystemExit):
            tyro.cli(script.Args, args=flags)
        return
    args = tyro.cli(script.Args, args=flags)
    with pytest.raises(SystemExit, match=re.escape(f"error: {message}")):
        script.check_args(args)


def test_defaults_are_the_papers_loss_without_dual_clip(script):
    import tyro

    args = tyro.cli(script.Args, args=[])
    assert (args.off_policy_correction, args.importance_weight_cap, args.dual_clip) == ("paper", 2.0, None)
    assert tyro.cli(script.Args, args=["--dual-clip", "3"]).dual_clip == 3.0


@pytest.mark.parametrize("learner_dtype", ["float32", "bfloat16"])
def test_the_first_mini_batch_anchor_taken_from_its_training_forward_is_a_no_grad_pass_bit_for_bit(tiny,
                                                                                                   learner_dtype):
    """GRPO takes the anchor of its first mini-batch (no update yet) from that mini-batch's own training forward,
    detached, instead of a separate no-grad pass: the update is the same only if the two are equal bit for bit, in
    the loop's micro-batches, under either --learner-dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    grpo = load_script("async_grpo_gsm8k.py")
    tokenizer = AutoTokenizer.from_pretrained(tiny / "policy")
    model = AutoModelForCausalLM.from_pretrained(tiny / "policy", dtype=torch.float32).eval()
    prompts = [tokenizer(f"Natalia sold {n} clips").input_ids for n in range(6)]
    responses = [tokenizer(" to her friends" * (1 + n % 3)).input_ids for n in range(6)]
    ids, attn, resp = grpo.pad_sequences(prompts, responses, tokenizer.pad_token_id, "cpu")
    args = grpo.Args(learner_device="cpu", learner_dtype=learner_dtype, micro_batch_size=4, temperature=0.7)
    mini_batches = grpo.chunks(torch.arange(6), 6)
    no_grad = grpo.token_logprobs_no_grad(model, ids, attn, resp, args, mini_batches)
    assert not grpo.token_logprobs_no_grad(model, ids, attn, resp, args, mini_batches[1:]).any()  # none: no pass
    for rows in grpo.chunks(mini_batches[0], args.micro_batch_size):  # the loop's micro-batches, with gradient
        with grpo.learner_autocast(args):
            trained = grpo.token_logprobs(model, ids[rows], attn[rows], resp[rows], args.temperature)
        assert trained.requires_grad and torch.equal(trained.detach(), no_grad[rows])


def test_effective_sample_size_is_kish_s_fraction(script):
    ess = script.effective_sample_size
    assert ess(torch.ones(8)) == pytest.approx(1.0)
    assert ess(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)  # one term carries the batch: 1/n
    assert ess(torch.tensor([2.0, 1.0, 1.0, 0.0])) == pytest.approx(16 / (4 * 6))
