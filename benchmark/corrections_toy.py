"""Which off-policy correction keeps RLOO's gradient when the samples are K policy versions old? A toy whose true
gradient is exact, so every correction's error can be measured rather than argued.

    python benchmark/corrections_toy.py              # 3 seeds, 4 drift levels: results/corrections_toy/ (~2-3 min)
    python benchmark/corrections_toy.py --seeds 1 --learning-rates 0.1 --output /tmp/toy.md

The toy. An autoregressive softmax policy over V = 8 tokens writes T = 24 tokens after a one-token prompt (uniform);
its logits are a table theta[t, previous token, next token] (a bigram policy per position, 1,536 parameters). The
reward is sequence-level and binary, as the staleness benchmark's verifier: 1 if at least `--threshold` of the 24
transitions follow a hidden successor table (y_t = succ[y_{t-1}]), else 0. J(theta) = P(reward = 1) and its gradient
are exact: a forward pass over the states (previous token, transitions hit so far) gives J, autograd gives grad J.

The staleness. The policy is trained by on-policy RLOO (16 prompts x k = 4 samples, leave-one-out baseline, Adam at
`--learning-rates`) until J reaches `--target-objective`; pi_old is that policy, mu the one K = 8 steps earlier, as in
an async run where the batch of learner step i comes from policy version i-K. The learning rate sets how far the K
steps move the policy; each level reports the mean per-token |log pi_old - log mu| of mu's samples, which the scripts
log as `async/behaviour_learner_logprob_gap` (the staleness benchmark's K = 8 RLOO runs under the paper's loss: mean
9.2e-3 over a run, largest 6.8e-2; benchmark/results/staleness/staleness.md).

The estimators. Samples y ~ mu, RLOO advantages A (no KL penalty: only the correction differs), N = 1 (one update per
batch, the staleness benchmark's async-K), clip range eps = 0.2, cap c = 2 (the scripts' defaults). With
rho_t = pi_old(y_t | y_<t) / mu(y_t | y_<t) per token and rho = prod_t rho_t per sequence, each estimator is
(1/n) sum_i sum_t C_it grad log pi(y_it | y_i,<t) at pi = pi_old, with the coefficient C_it:

  on-policy            A_i on samples of pi_old itself: what every correction tries to recover (noise floor).
  paper                A_i: the paper's loss; its ratio pi/pi_old is 1 at the only update, so nothing is corrected.
  behaviour            A_i rho_i, or 0 where PPO's clip on the sequence ratio pi/mu wins (A > 0 and rho > 1 + eps, or
                       A < 0 and rho < 1 - eps): verl's bypass mode, TRL's async GRPO, PipelineRL's PPO loss.
  seq-truncated        A_i min(rho_i, c): RLOO's `decoupled` before this toy, decoupled PPO (Hilton et al., 2022,
                       "Batch size-invariance for policy optimization") with a truncated sequence weight.
  seq-untruncated      A_i rho_i: ordinary importance sampling of whole sequences (unbiased, heavy-tailed).
  seq-length-normed    A_i min(exp(mean_t log rho_t), c): the sequence weight normalised by length, the geometric mean
                       of the per-token ratios, as GSPO's sequence ratio (Zheng et al., 2025, "Group Sequence Policy
                       Optimization"; PipelineRL's `gspo` loss).
  token-truncated      A_i min(rho_it, c): truncated importance sampling per token (Yao et al., 2025, "Your efficient RL
                       framework secretly brings you off-policy RL training", TIS; PipelineRL's `reinforce` loss
                       weights each token by its detached, truncated ratio to the sampler, Piche et al., 2025).
                       RLOO's `decoupled` now (docs/rloo.md: at N = 1 its update is exactly this estimator).
  token-untruncated    A_i rho_it: the same without truncation, to separate truncation's bias from the per-token form's.

The per-token forms drop the ratios of the other tokens (the prefix's, which reweight the states, and the suffix's,
which reweight the return): they are biased even untruncated, but their weights are products of one token, not 24.

Reported per estimator, mean +- std over seeds: the cosine and the relative error |E g - g*| / |g*| of its expectation
(E g from `--expectation-samples` samples of mu: bias only), the mean cosine of a single batch's estimate (16 prompts x
4 samples, what one learner step sees: bias and variance), the fraction of terms the clip leaves without gradient (the
scripts' `policy/zero_gradient_frac`), and the Kish effective sample size of the weights the estimator multiplies its
terms with (sequence weights, or token weights for the per-token forms; behaviour's are rho, 0 where clipped), per
batch as the scripts' `policy/importance_weight_ess`.
"""

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import torch
import tyro

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds (each: its own successor table, initial policy, training run and samples)"""
    learning_rates: List[float] = field(default_factory=lambda: [0.003, 0.01, 0.03, 0.1])
    """Adam learning rates of the training run: how far K steps move the policy (one table per rate)"""
    vocab: int = 8
    """tokens V"""
    length: int = 24
    """response tokens T"""
    threshold: int = 9
    """reward 1 if at least this many transitions follow the successor table"""
    target_objective: float = 0.4
    """pi_old is the first policy of the training run with J >= this (and at least K steps in): about the same point of
    the task at every learning rate, so the rates differ mainly in how far K steps move the policy"""
    max_steps: int = 2000
    """give up if J has not reached the target after this many steps"""
    async_steps: int = 8
    """K: mu is the policy K steps before pi_old"""
    prompts_per_step: int = 16
    """prompts per batch (training and the per-batch measurement)"""
    num_samples_per_prompt: int = 4
    """k samples per prompt (leave-one-out baseline)"""
    cliprange: float = 0.2
    """PPO clip range (behaviour)"""
    importance_weight_cap: float = 2.0
    """truncation cap c"""
    expectation_samples: int = 2**20
    """samples of mu (and of pi_old, for the on-policy row) that estimate each estimator's expectation"""
    output: str = str(REPO / "benchmark" / "results" / "corrections_toy" / "corrections_toy.md")
    """where the markdown report goes"""


def policy_logprobs(theta):
    return torch.log_softmax(theta, dim=-1)  # (T, V, V): log pi_t(next | previous)


def exact_objective(theta, succ, threshold):
    """J = P(at least `threshold` transitions hit succ), by a forward pass over (previous token, hits so far)."""
    length, vocab, _ = theta.shape
    probs = torch.softmax(theta, dim=-1)
    hit = torch.zeros(vocab, vocab, dtype=theta.dtype)
    hit[torch.arange(vocab), succ] = 1.0
    state = torch.zeros(vocab, length + 1, dtype=theta.dtype)
    state[:, 0] = 1.0 / vocab  # the prompt token
    for t in range(length):
        miss_next = torch.einsum("sc,sa->ac", state, probs[t] * (1 - hit))
        hit_next = torch.einsum("sc,sa->ac", state, probs[t] * hit)
        state = miss_next + torch.nn.functional.pad(hit_next[:, :-1], (1, 0))
    return state[:, threshold:].sum()


def sample(theta, n, generator):
    """n sequences: the prompt token and T sampled tokens, (n, T + 1)."""
    length, vocab, _ = theta.shape
    cdf = torch.softmax(theta, dim=-1).cumsum(-1)
    tokens = torch.empty(n, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (n,), generator=generator)
    for t in range(length):
        u = torch.rand(n, 1, generator=generator, dtype=theta.dtype)
        tokens[:, t + 1] = (u > cdf[t, tokens[:, t]]).sum(-1).clamp(max=vocab - 1)
    return tokens


def token_logprobs(logp, tokens):
    t = torch.arange(logp.shape[0])
    return logp[t, tokens[:, :-1], tokens[:, 1:]]  # (n, T)


def rewards_of(tokens, succ, threshold):
    return ((tokens[:, 1:] == succ[tokens[:, :-1]]).sum(1) >= threshold).to(torch.float64)


def rloo_advantages(rewards, k):
    grouped = rewards.view(-1, k)
    return (grouped - (grouped.sum(1, keepdim=True) - grouped) / (k - 1)).flatten()


def gradient_estimates(theta, tokens, coefficients, batch_size):
    """Per batch of `batch_size` sequences: (1/n) sum_i sum_t C_it grad_theta log pi_t(y_it | y_i,t-1), using
    d log softmax(theta[t, s])[a] / d theta[t, s, :] = onehot(a) - pi_t(. | s). Returns (batches, T * V * V)."""
    length, vocab, _ = theta.shape
    n = tokens.shape[0]
    batches = n // batch_size
    batch = torch.arange(n).div(batch_size, rounding_mode="floor")[:, None]
    state = batch * length * vocab + torch.arange(length) * vocab + tokens[:, :-1]  # (n, T): batch, position, previous
    chosen = torch.bincount(
        (state * vocab + tokens[:, 1:]).flatten(),
        weights=coefficients.flatten(),
        minlength=batches * length * vocab * vocab,
    ).view(batches, length, vocab, vocab)
    visited = torch.bincount(state.flatten(), weights=coefficients.flatten(), minlength=batches * length * vocab).view(
        batches, length, vocab, 1
    )
    return ((chosen - visited * torch.softmax(theta, dim=-1)) / batch_size).flatten(1)


def kish(weights):
    """Kish's effective sample size as a fraction of the weights' number, per row."""
    return weights.sum(1) ** 2 / (weights.shape[1] * (weights**2).sum(1)).clamp(min=1e-300)


def coefficients(mode, advantages, log_rho_tokens, args):
    """C_it of each estimator (docstring), the weight each term carries, and the mask of clipped terms."""
    n, length = log_rho_tokens.shape
    cap, eps = args.importance_weight_cap, args.cliprange
    log_rho = log_rho_tokens.sum(1)
    rho = log_rho.clamp(max=20.0).exp()  # the scripts clamp the sequence log-ratio at 20 before exp
    clipped = torch.zeros(n, dtype=torch.bool)
    if mode in ("on-policy", "paper"):
        weight = torch.ones(n, dtype=torch.float64)
    elif mode == "behaviour":
        clipped = ((advantages > 0) & (rho > 1 + eps)) | ((advantages < 0) & (rho < 1 - eps)) | (log_rho > 20.0)
        weight = torch.where(clipped, 0.0, rho)
    elif mode == "seq-truncated":
        weight = rho.clamp(max=cap)
    elif mode == "seq-untruncated":
        weight = rho
    elif mode == "seq-length-normed":
        weight = log_rho_tokens.mean(1).exp().clamp(max=cap)
    elif mode == "token-truncated":
        weight = log_rho_tokens.exp().clamp(max=cap)
    elif mode == "token-untruncated":
        weight = log_rho_tokens.exp()
    else:
        raise ValueError(mode)
    per_token = weight if weight.dim() == 2 else weight[:, None].expand(n, length)
    return advantages[:, None] * per_token, weight, clipped


MODES = [
    "on-policy",
    "paper",
    "behaviour",
    "seq-truncated",
    "seq-untruncated",
    "seq-length-normed",
    "token-truncated",
    "token-untruncated",
]


def measure(args, seed, learning_rate):
    generator = torch.Generator().manual_seed(seed)
    V, T, k = args.vocab, args.length, args.num_samples_per_prompt
    batch_size = args.prompts_per_step * k
    succ = torch.randperm(V, generator=generator)
    theta = torch.randn(T, V, V, generator=generator, dtype=torch.float64) * 0.5
    theta[:, torch.arange(V), succ] += 1.0  # the initial policy: J ~ 0.15-0.18, as the benchmark's SFT gold 0.2
    theta.requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=learning_rate)
    history = [theta.detach().clone()]
    # on-policy RLOO: the policies an async run moves through, until J reaches the target K or more steps in
    while (
        len(history) <= args.async_steps or exact_objective(history[-1], succ, args.threshold) < args.target_objective
    ):
        if len(history) > args.max_steps:
            raise SystemExit(
                f"error: J stayed below --target-objective {args.target_objective} for {args.max_steps} "
                f"steps at learning rate {learning_rate:g}"
            )
        with torch.no_grad():
            tokens = sample(theta.detach(), batch_size, generator)
            advantages = rloo_advantages(rewards_of(tokens, succ, args.threshold), k)
            grad = gradient_estimates(theta.detach(), tokens, advantages[:, None].expand(-1, T), batch_size)[0]
        theta.grad = -grad.view_as(theta)  # ascent on J
        optimizer.step()
        history.append(theta.detach().clone())
    old, behaviour = history[-1], history[-1 - args.async_steps]
    old_exact = old.clone().requires_grad_(True)
    objective = exact_objective(old_exact, succ, args.threshold)
    (true_grad,) = torch.autograd.grad(objective, old_exact)
    true_grad = true_grad.flatten()
    logp_old, logp_mu = policy_logprobs(old), policy_logprobs(behaviour)

    sums = {mode: torch.zeros_like(true_grad) for mode in MODES}
    per_batch = {}
    gaps, chunk = [], 2**16
    for start in range(0, args.expectation_samples, chunk):
        samples = {}
        for name, policy in (("mu", behaviour), ("old", old)):
            tokens = sample(policy, chunk, generator)
            log_rho_tokens = token_logprobs(logp_old, tokens) - token_logprobs(logp_mu, tokens)
            samples[name] = tokens, log_rho_tokens, rloo_advantages(rewards_of(tokens, succ, args.threshold), k)
        gaps.append(samples["mu"][1].abs().mean().item())
        for mode in MODES:
            tokens, log_rho_tokens, advantages = samples["old" if mode == "on-policy" else "mu"]
            c, weight, clipped = coefficients(mode, advantages, log_rho_tokens, args)
            sums[mode] += gradient_estimates(old, tokens, c, chunk)[0] * chunk
            if start == 0:  # one chunk's batches are plenty for the per-batch means
                grads = gradient_estimates(old, tokens, c, batch_size)
                per_batch[mode] = dict(
                    batch_cos=torch.nn.functional.cosine_similarity(grads, true_grad[None], dim=1).mean().item(),
                    zero=clipped.double().mean().item(),
                    zero_positive=((advantages > 0) & clipped).double().sum().item() / max(1, clipped.sum().item()),
                    ess=kish(weight.reshape(-1, batch_size * (T if weight.dim() == 2 else 1))).mean().item(),
                )
    row = {}
    for mode in MODES:
        mean = sums[mode] / args.expectation_samples
        row[mode] = dict(
            cos=torch.nn.functional.cosine_similarity(mean, true_grad, dim=0).item(),
            rel_error=((mean - true_grad).norm() / true_grad.norm()).item(),
            **per_batch[mode],
        )
    level = dict(
        gap=sum(gaps) / len(gaps),
        objective_old=objective.item(),
        steps=len(history) - 1,
        objective_mu=exact_objective(behaviour, succ, args.threshold).item(),
    )
    return row, level


def mean_std(values, digits=3):
    t = torch.tensor(values, dtype=torch.float64)
    return f"{t.mean().item():.{digits}f} ± {t.std().item() if len(values) > 1 else 0.0:.{digits}f}"


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.expectation_samples % 2**16 or args.expectation_samples < 2**16:
        raise SystemExit(f"error: --expectation-samples must be a multiple of 65536, got {args.expectation_samples}")
    torch.set_num_threads(1)
    start = time.time()
    lines = []
    for learning_rate in args.learning_rates:
        results = [measure(args, seed, learning_rate) for seed in args.seeds]
        levels = [level for _, level in results]
        level = {key: mean_std([lv[key] for lv in levels], 0 if key == "steps" else 3) for key in levels[0]}
        lines += [
            "",
            f"### Adam learning rate {learning_rate:g}: per-token gap |log pi_old - log mu| {level['gap']}, "
            f"after {level['steps']} steps, J(mu) {level['objective_mu']} -> J(pi_old) {level['objective_old']}",
            "",
            "| estimator | cos(E g, g*) | \\|E g - g*\\| / \\|g*\\| | cos per batch | zero-gradient terms | "
            "of which A > 0 | ESS |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode in MODES:
            cells = [
                mean_std([row[mode][key] for row, _ in results])
                if mode == "behaviour" or key != "zero_positive"
                else "–"
                for key in ("cos", "rel_error", "batch_cos", "zero", "zero_positive", "ess")
            ]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        print("\n".join(lines[-len(MODES) - 5 :]), flush=True)
    flags = " ".join(
        f"--{key.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for key, v in vars(args).items()
        if key != "output" and v != getattr(Args(), key)
    )
    header = [
        "# Off-policy corrections for RLOO on a toy with an exact gradient",
        "",
        f"Produced by `python benchmark/corrections_toy.py{' ' + flags if flags else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')} ({time.time() - start:.0f} s, 1 CPU thread); the estimators and the toy "
        "are defined in its docstring. Mean ± std over seeds "
        f"{', '.join(map(str, args.seeds))}. V = {args.vocab} tokens, T = {args.length}, reward 1 if at least "
        f"{args.threshold} transitions hit; {args.prompts_per_step} prompts x k = {args.num_samples_per_prompt} per "
        f"batch; mu = pi_old {args.async_steps} RLOO steps back, pi_old the first policy with J >= "
        f"{args.target_objective}; eps {args.cliprange}, cap {args.importance_weight_cap}; expectations from "
        f"{args.expectation_samples:,} samples.",
        "",
        "cos(E g, g*) and the relative error are of the estimator's expectation (bias; the on-policy row's error is "
        "the sampling noise of that expectation); cos per batch is of one batch's estimate (bias and variance); "
        "zero-gradient terms: the fraction of sequences the clip leaves without gradient "
        "(`policy/zero_gradient_frac`), and the share of those with a positive advantage; ESS: Kish's effective "
        "sample size of the weights per batch, as a fraction (sequences, or tokens for the token-level forms).",
    ]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(header + lines) + "\n")
    print(f"wrote {args.output} in {time.time() - start:.0f} s")
