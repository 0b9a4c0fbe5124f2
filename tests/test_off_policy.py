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
    """Each script's loss on four terms, four one-token responses: RLOO's terms are its sequences, PPO's and GRPO's
    their tokens."""
    column = lambda x: x[:, None]
    mask = torch.ones(4, 1)
    if hasattr(module, "rloo_advantages"):
        return module.clipped_policy_loss(
            column(new), column(anchor), column(weights), advantages, mask, 0.2, dual_clip
        )
    if hasattr(module, "compute_gae"):  # PPO: per-token advantages
        return module.clipped_policy_loss(
            column(new), column(anchor), column(weights), column(advantages), mask, 0.2, dual_clip
        )
    return module.grpo_policy_loss(
        column(new), column(anchor), column(weights), advantages, mask, 0.2, dual_clip, "sequence", None
    )


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
#   gradient 1.5 * -1 / 4, 2 * 1.1 / 4. RLOO's weights scale each token's gradient and leave the loss's value alone:
#   its loss reads paper's -0.475, its gradient is the same as here
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
    if hasattr(script, "rloo_advantages") and mode == "decoupled":
        expected_loss = EXPECTED["paper"][0]
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert new.grad.flatten().tolist() == pytest.approx(expected_grad, abs=1e-5)
    assert stats["policy/zero_gradient_frac"] == pytest.approx(zero_gradient_frac)
    assert stats["policy/clipfrac"] == pytest.approx(clipfrac)
    assert stats["policy/importance_weight_mean"] == pytest.approx(weight_mean)


def test_the_dual_clip_bounds_a_negative_advantage_and_cuts_its_gradient(script):
    new, _, behaviour, advantages = stale_example()
    anchor, weights = script.off_policy_anchor("behaviour", None, behaviour, 2.0)
    loss, stats = policy_loss(script, new, anchor, weights, advantages, dual_clip=3.0)
    loss.backward()
    # term 2 (A = -1, r = 4.4 > 3) now loses -A * 3 = 3 instead of 4.4, with no gradient: (-1.2 + 3 - 1.3 + 0.4) / 4
    assert loss.item() == pytest.approx(0.225, abs=1e-5)
    assert new.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.325, 0.0], abs=1e-5)
    assert stats["policy/zero_gradient_frac"] == pytest.approx(0.75)


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
        assert stats["policy/importance_ratio_max"] == 1.0 and stats["policy/importance_weight_mean"] == 1.0
        assert stats["policy/zero_gradient_frac"] == 0.0
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
    new = torch.full((2, 2), -0.5, requires_grad=True)  # two tokens of log-ratio 50 each: 100 per sequence
    for dual_clip, expected in ((3.0, (3.0 - 1.2) / 2), (None, None)):
        anchor, weights = rloo.off_policy_anchor(
            "decoupled", torch.full((2, 2), -50.5), torch.full((2, 2), -150.0), 2.0
        )
        loss, _ = rloo.clipped_policy_loss(
            new, anchor, weights, torch.tensor([-1.0, 1.0]), torch.ones(2, 2), 0.2, dual_clip
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(new.grad).all() and (weights == 2.0).all()
        if expected is not None:
            assert loss.item() == pytest.approx(expected)  # the weights scale the gradient, not the loss's value
        new.grad = None


def test_rloo_weights_each_token_and_clips_each_sequence_by_hand():
    """RLOO's decoupled weights are per token, min(pi_old(y_t) / mu(y_t), 2); the PPO clip stays on the sequence ratio.
    Two sequences; the second has two response tokens (its third column is padding, 0 as `token_logprobs` leaves it):
        sequence  A    pi_old/mu per token   weights          pi/pi_old per token  ratio
        1         +2   1.5, 4.0, 0.5         1.5, 2.0, 0.5    1, 1, 1              1.0
        2         +1   1.0, 2.5, -           1.0, 2.0, -      1.5, 1.0, -          1.5 > 1.2: clipped
    loss (-2 * 1 + -1 * 1.2) / 2 = -1.6; gradient -A r w_t / 2: -1.5, -2, -0.5 for sequence 1, none for sequence 2."""
    rloo = load_script("async_rloo.py")
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    old = (behaviour + torch.tensor([[1.5, 4.0, 0.5], [1.0, 2.5, 1.0]]).log()) * mask
    new = (old + torch.tensor([[1.0, 1.0, 1.0], [1.5, 1.0, 1.0]]).log()).requires_grad_(True)
    anchor, weights = rloo.off_policy_anchor("decoupled", old, behaviour, 2.0)
    assert (weights * mask).flatten().tolist() == pytest.approx([1.5, 2.0, 0.5, 1.0, 2.0, 0.0])
    loss, stats = rloo.clipped_policy_loss(new * mask, anchor, weights, torch.tensor([2.0, 1.0]), mask, 0.2, None)
    loss.backward()
    assert loss.item() == pytest.approx(-1.6)
    assert new.grad.flatten().tolist() == pytest.approx([-1.5, -2.0, -0.5, 0.0, 0.0, 0.0])
    assert stats["policy/importance_ratio_max"] == pytest.approx(1.5)
    assert stats["policy/clipfrac"] == stats["policy/zero_gradient_frac"] == 0.5
    # the weight statistics are over the five response tokens: mean 7 / 5, ESS 7^2 / (5 * 11.5) (which the scripts log
    # for the whole batch, from its weights, not per micro-batch)
    assert stats["policy/importance_weight_mean"] == pytest.approx(1.4) and "policy/importance_weight_ess" not in stats
    assert rloo.effective_sample_size(weights[mask.bool()]) == pytest.approx(49 / 57.5)


def test_rloo_decoupled_is_paper_when_the_sampler_is_the_learner():
    """mu = pi_old (sync, or K = 0): every weight is 1, and decoupled mode trains exactly as paper mode."""
    rloo = load_script("async_rloo.py")
    torch.manual_seed(0)
    mask = (torch.rand(6, 5) < 0.8).float()
    old = -torch.rand(6, 5) * 3 * mask
    advantages = torch.randn(6)
    results = []
    for mode in ("paper", "decoupled"):
        new = (old + 0.2 * torch.randn(6, 5, generator=torch.Generator().manual_seed(1))).requires_grad_(True)
        anchor, weights = rloo.off_policy_anchor(mode, old, old, 2.0)
        assert torch.equal(weights, torch.ones_like(old))
        loss, stats = rloo.clipped_policy_loss(new * mask, anchor, weights, advantages, mask, 0.2, None)
        loss.backward()
        results.append((loss.item(), new.grad.clone(), stats))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


def test_rloo_gradient_is_the_per_token_weighted_policy_gradient():
    """On a tiny autoregressive softmax policy (logits per position and previous token), the loss's gradient equals
    -1/B sum_i [not clipped_i] A_i r_i sum_t w_it grad log pi(y_it | y_i,t-1), with grad_theta[t, s] log softmax(
    theta[t, s])[a] = onehot(a) - softmax(theta[t, s]): the sequence clip and ratio, per-token weights."""
    rloo = load_script("async_rloo.py")
    g = torch.Generator().manual_seed(0)
    length, vocab, batch = 4, 5, 6
    logits_mu = torch.randn(length, vocab, vocab, generator=g)
    logits_old = logits_mu + 0.5 * torch.randn(length, vocab, vocab, generator=g)  # K versions later
    theta = (logits_old + 0.3 * torch.randn(length, vocab, vocab, generator=g)).requires_grad_(True)  # a later update
    tokens = torch.randint(vocab, (batch, length + 1), generator=g)  # column 0: the prompt token
    mask = torch.ones(batch, length)
    mask[0, 3:] = mask[1, 2:] = 0.0  # shorter responses
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -0.2])
    positions = torch.arange(length)

    def logprobs(logits):  # (batch, length): log pi_t(y_t | y_t-1), 0 off the response
        return torch.log_softmax(logits, -1)[positions, tokens[:, :-1], tokens[:, 1:]] * mask

    anchor, weights = rloo.off_policy_anchor("decoupled", logprobs(logits_old), logprobs(logits_mu), 2.0)
    assert (weights * mask).max() == 2.0 and (weights * mask)[mask.bool()].min() < 1.0  # some truncated, some below 1
    loss, stats = rloo.clipped_policy_loss(logprobs(theta), anchor, weights, advantages, mask, 0.2, None)
    loss.backward()

    with torch.no_grad():
        ratio = torch.exp((logprobs(theta) - anchor).sum(1))
        clipped = ((advantages > 0) & (ratio > 1.2)) | ((advantages < 0) & (ratio < 0.8))
        assert 0 < clipped.sum() < batch and stats["policy/zero_gradient_frac"] == pytest.approx(clipped.float().mean())
        expected = torch.zeros_like(theta)
        probs = torch.softmax(theta, -1)
        for i in range(batch):
            for t in range(length):
                if mask[i, t] and not clipped[i]:
                    score = torch.nn.functional.one_hot(tokens[i, t + 1], vocab) - probs[t, tokens[i, t]]
                    expected[t, tokens[i, t]] -= advantages[i] * ratio[i] * weights[i, t] * score / batch
    assert torch.allclose(theta.grad, expected, atol=1e-6)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--off-policy-correction", "tis"], None),
        (
            ["--importance-weight-cap", "0.5"],
            "--importance-weight-cap must be >= 1 (a cap below 1 down-weights on-policy samples), got 0.5",
        ),
        (["--dual-clip", "1.0"], "--dual-clip must be > 1 + --cliprange = 1.2 (or None), got 1.0"),
        (["--dual-clip", "1.1"], "--dual-clip must be > 1 + --cliprange = 1.2 (or None), got 1.1"),  # inside the clip
    ],
)
def test_bad_correction_flags_are_rejected(script, flags, message):
    import tyro

    if message is None:  # not one of the choices: tyro names the flag and the choices
        with pytest.raises(SystemExit):
            tyro.cli(script.RunArgs, args=flags)
        return
    args = tyro.cli(script.RunArgs, args=flags)
    with pytest.raises(SystemExit, match=re.escape(f"error: {message}")):
        script.check_args(args)


def test_defaults_are_the_papers_loss_without_dual_clip(script):
    import tyro

    args = tyro.cli(script.RunArgs, args=[])
    assert (args.off_policy_correction, args.importance_weight_cap, args.dual_clip) == ("paper", 2.0, None)
    assert tyro.cli(script.RunArgs, args=["--dual-clip", "3"]).dual_clip == 3.0


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("model_name", ["llama", "neox"])
@pytest.mark.parametrize("learner_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algo", ["grpo_gsm8k", "rloo", "ppo"])
def test_the_first_mini_batch_anchor_taken_from_its_training_forward_is_a_no_grad_pass_bit_for_bit(
    tiny, algo, learner_dtype, model_name, gradient_checkpointing
):
    """The multigpu variants take pi_old of their first mini-batch (no update yet) from its own training forward,
    detached, instead of the no-grad pass their cores make (RLOO and PPO of its first micro-batch only, run
    before the others' no-grad passes, as their rewards need pi_old of every row before the first loss; PPO its values
    V_old too): the update is the same only if the two are equal bit for bit, in the loop's micro-batches, under either
    --learner-dtype, on a Llama and a GPT-NeoX (Pythia) model, and with --gradient-checkpointing, which runs the models
    in training mode (its dropouts set to 0) and their layers through torch.utils.checkpoint."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    # the shortcut lives in the multigpu variants (the cores do the plain no-grad passes), loaded here as one process
    script = load_script(f"multigpu/async_{algo}_multigpu.py")
    prefix = "neox_" if model_name == "neox" else ""
    tokenizer = AutoTokenizer.from_pretrained(tiny / f"{prefix}policy")
    # dropout in the config, which only --gradient-checkpointing's training mode could turn on (Pythia's and the tiny
    # models' are 0): the helper must set every dropout to 0, or the two passes draw different masks
    dropout = dict(attention_dropout=0.1, hidden_dropout=0.1) if model_name == "neox" else dict(attention_dropout=0.1)
    model = AutoModelForCausalLM.from_pretrained(tiny / f"{prefix}policy", dtype=torch.float32, **dropout).eval()
    value_model = None
    if algo == "ppo":  # the critic: the reward model's weights, trained, as in the variant's main
        value_model = AutoModelForSequenceClassification.from_pretrained(
            tiny / f"{prefix}rm", num_labels=1, dtype=torch.float32, **dropout
        ).eval()
        value_model.config.pad_token_id = tokenizer.pad_token_id  # as the variant's main: its forward pools at padding
    for trained in filter(None, (model, value_model)):
        if gradient_checkpointing:  # as the variant's main does for --gradient-checkpointing
            script.enable_gradient_checkpointing(trained)
        assert trained.is_gradient_checkpointing == trained.training == gradient_checkpointing
    prompts = [tokenizer(f"Natalia sold {n} clips").input_ids for n in range(6)]
    responses = [tokenizer(" to her friends" * (1 + n % 3)).input_ids for n in range(6)]
    ids, attn, resp = script.pad_sequences(prompts, responses, tokenizer.pad_token_id, "cpu")
    args = script.RunArgs(
        learner_device="cpu",
        learner_dtype=learner_dtype,
        micro_batch_size=4,
        temperature=0.7,
        gradient_checkpointing=gradient_checkpointing,
    )
    mini_batches = script.chunks(torch.tensor([4, 1, 5, 0, 3, 2]), 6)  # shuffled rows, as PPO's epochs
    no_grad = script.token_logprobs_no_grad(model, ids, attn, resp, args, mini_batches)
    assert not script.token_logprobs_no_grad(model, ids, attn, resp, args, mini_batches[1:]).any()  # none: no pass
    for rows in script.chunks(mini_batches[0], args.micro_batch_size):  # the loop's micro-batches, with gradient
        with script.learner_autocast(args):
            trained = (script.token_logprobs_and_entropy if algo == "ppo" else script.token_logprobs)(
                model, ids[rows], attn[rows], resp[rows], args.temperature
            )
        trained = trained[0] if algo == "ppo" else trained
        assert trained.requires_grad and torch.equal(trained.detach(), no_grad[rows])
    if algo == "ppo":  # V_old: the value model's no-grad pass (the loop's, inline) against its training forward
        for rows in script.chunks(mini_batches[0], args.micro_batch_size):
            with torch.no_grad(), script.learner_autocast(args):
                values = script.get_values(value_model, ids[rows], attn[rows])
            with script.learner_autocast(args):
                trained = script.get_values(value_model, ids[rows], attn[rows])
            assert trained.requires_grad and torch.equal(trained.detach(), values)


def test_effective_sample_size_is_kish_s_fraction(script):
    ess = script.effective_sample_size
    assert ess(torch.ones(8)) == pytest.approx(1.0)
    assert ess(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)  # one term carries the batch: 1/n
    assert ess(torch.tensor([2.0, 1.0, 1.0, 0.0])) == pytest.approx(16 / (4 * 6))


def test_the_logprob_gap_adds_up_over_micro_batches_and_ranks(script):
    """logprob_gap gives [sum |learner - vLLM|, tokens] of its rows, so the logged gap (their ratio, summed over every
    micro-batch before the step's first update and over the ranks) is the mean over all those tokens, however the rows
    are split: here a 1-token and a 3-token response, whose mean gaps (0.5 and 0.1) a mean of means would weigh alike."""
    learner = torch.tensor([[-1.5, 0.0, 0.0, 0.0], [-1.0, -2.0, -3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])  # prompt token, then the response; column t = token t+1
    behaviour = [[-1.0], [-0.9, -2.1, -3.1]]
    parts = [script.logprob_gap(learner[i : i + 1], mask[i : i + 1], behaviour, torch.tensor([i])) for i in range(2)]
    whole = script.logprob_gap(learner, mask, behaviour, torch.arange(2))
    assert whole.dtype == torch.float64 and whole.tolist() == pytest.approx([0.8, 4.0])
    assert (parts[0] + parts[1]).tolist() == pytest.approx(whole.tolist())
    assert (whole[0] / whole[1]).item() == pytest.approx(0.2)  # not (0.5 + 0.1) / 2
