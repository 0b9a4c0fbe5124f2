"""async_grpo_gsm8k.py and sync_baselines/sync_grpo_gsm8k.py: verifier, advantages, loss, data, end-to-end runs."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GSM8K_DIR, REPO, load_script, read_metrics, run_script

ASYNC, SYNC = "async_grpo_gsm8k.py", "sync_baselines/sync_grpo_gsm8k.py"


@pytest.fixture(scope="module")
def grpo():
    return load_script(ASYNC)


def common_flags(tiny: Path, *extra: str):
    # temperature 1 and 16 problems x 4 samples: enough groups with mixed rewards that the tiny policy really learns
    return (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--max-prompt-tokens",
        "256",
        "--response-length",
        "16",
        "--prompts-per-step",
        "16",
        "--num-samples-per-prompt",
        "4",
        "--temperature",
        "1.0",
        "--learning-rate",
        "3e-3",
        "--seed",
        "3",
        "--sample-every",
        "2",
        "--num-eval-prompts",
        "8",
        "--eval-every",
        "2",
        "--kv-cache-gib",
        "0.25",
        *extra,
    )


@pytest.fixture(scope="module")
def arithmetic():
    return load_script("tools/make_arithmetic.py")


@pytest.fixture(scope="module")
def gsm8k_folder(tmp_path_factory):
    """A few lines of the shared GSM8K files, as a --dataset-path folder."""
    folder = tmp_path_factory.mktemp("gsm8k")
    for split, n in (("train", 16), ("test", 8)):
        with open(GSM8K_DIR / f"{split}.jsonl") as f:
            (folder / f"{split}.jsonl").write_text("".join(line for _, line in zip(range(n), f)))
    return folder


# ---------------------------------------------------------------- verifier
@pytest.mark.parametrize(
    "text,expected",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("#### 1,234", "1234"),
        ("#### $1,234.00", "1234"),
        ("The answer is 7.\n#### -5", "-5"),  # the marker wins over later or earlier numbers
        ("#### 3.50 dollars, not 4", "3.5"),
        ("#### 12.0", "12"),
        ("#### 18\nNext problem: 3 + 4 = 7\n#### 7", "18"),  # the first marker: what follows is a new problem
        ("So 5-3 = 2 apples", "2"),  # fallback: last number; the minus of "5-3" is not a sign
        ("it fell to -7 degrees", "-7"),
        ("He has 1,000 coins and 20 more", "20"),
        ("The total is $2,500.", "2500"),  # a sentence-final period is not a decimal point
        ("costs 0.25 each", "0.25"),
        ("#### the answer is 42", "42"),  # a marker without a number falls back to the last number
        ("#### 1 000", "1000"),  # thousands grouped by spaces, after the marker only
        ("#### 2.5e3", "2500"),  # an exponent
        ("it is 1.2E-2", "0.012"),
        ("#### 12,34", None),  # neither thousands nor a decimal point: refused, not read as 12 or 34
        ("#### 1,000,00", None),
        ("#### 5e999999999", None),  # an exponent of at most three digits: no billion-digit integer
        ("Answer: 3 500 apples", "500"),  # no space grouping outside the marker
        ("I do not know.", None),
        ("", None),
    ],
)
def test_extract_answer_on_tricky_strings(grpo, text, expected):
    assert grpo.extract_answer(text) == expected


def test_verify_compares_normalised_numbers(grpo):
    gold = grpo.extract_answer("So the answer is\n#### 1,500")
    assert gold == "1500"
    assert grpo.verify("... that is $1,500.00 in total.", gold, False) == (1.0, True)
    assert grpo.verify("#### 1499", gold, False) == (0.0, True)
    assert grpo.verify("no idea", gold, False) == (0.0, False)


def test_require_answer_marker_grades_only_the_marked_number_as_the_papers_code(grpo):
    """--require-answer-marker: a response cut off mid-solution ("... 4 + 4 = 8") is graded by its last number by
    default, and scores 0 with the flag, as in the paper's code; a marked answer counts either way."""
    cut_off = "Tom has 4 apples and buys 4 more, so 4 + 4 = 8"
    assert grpo.verify(cut_off, "8", False) == (1.0, True)
    assert grpo.verify(cut_off, "8", True) == (0.0, False)
    assert grpo.verify("4 + 4 = 8\n#### 8", "8", True) == (1.0, True)
    assert grpo.verify("4 + 4 = 8\n#### 9", "8", True) == (0.0, True)


# ---------------------------------------------------------------- advantages and loss
def test_group_advantages_with_and_without_std(grpo):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # 3 groups of 4
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350; group 2: equal rewards; group 3: mean 0.25,
    # std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    scaled = grpo.group_advantages(rewards, 4, scale_rewards=True)
    a1, a3, b3 = 0.5 / (0.577350 + 1e-4), 0.75 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4)
    assert scaled.tolist() == pytest.approx([a1, -a1, -a1, a1, 0, 0, 0, 0, a3, b3, b3, b3], abs=1e-5)
    centred = grpo.group_advantages(rewards, 4, scale_rewards=False)
    assert centred.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0.75, -0.25, -0.25, -0.25])


def test_kl_penalty_is_the_k3_estimator_per_sequence(grpo):
    new = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-1.5, -2.0], [-0.1, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    k3 = lambda d: math.exp(d) - d - 1  # d = log ref - log new
    expected = ((k3(-0.5) + k3(0.0)) / 2 + k3(0.4)) / 2
    assert grpo.kl_penalty(new, ref, mask, "sequence", 4).item() == pytest.approx(expected, abs=1e-6)
    # aggregated like the loss: over the 3 response tokens, or over 2 responses x a response length of 4
    total = k3(-0.5) + k3(0.0) + k3(0.4)
    assert grpo.kl_penalty(new, ref, mask, "token", 4).item() == pytest.approx(total / 3, abs=1e-6)
    assert grpo.kl_penalty(new, ref, mask, "constant", 4).item() == pytest.approx(total / 8, abs=1e-6)


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_loss_aggregations_by_hand_and_micro_batches_add_up_to_the_mini_batch(grpo, aggregation):
    """--loss-aggregation on hand-computed values (a 1-token and a 3-token response: the sequence mean weighs the
    short one's token 3x each of the long one's; the token mean weighs all alike; constant divides by 2 x 4), and the
    share-weighted micro-batches of one response each give the mini-batch's gradient exactly."""
    values = torch.tensor([[2.0, 0.0, 0.0], [1.0, 4.0, 7.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    expected = {"sequence": (2.0 + 12.0 / 3) / 2, "token": 14.0 / 4, "constant": 14.0 / (2 * 4)}[aggregation]
    assert grpo.aggregate(values, mask, aggregation, 4).item() == pytest.approx(expected)

    # the loop's layout: response_mask over the whole sequence, column t of the loss's mask = token t+1
    response_mask = torch.cat([torch.zeros(2, 1), mask], dim=1)
    weights = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], requires_grad=True)
    mini_batch = torch.arange(2)
    grpo.aggregate(weights * values, mask, aggregation, 4).backward()
    whole = weights.grad.clone()
    weights.grad = None
    for rows in (mini_batch[:1], mini_batch[1:]):
        share = grpo.micro_batch_share(rows, mini_batch, response_mask, aggregation)
        (grpo.aggregate(weights[rows] * values[rows], mask[rows], aggregation, 4) * share).backward()
    assert torch.allclose(weights.grad, whole)


def test_behaviour_logprobs_are_laid_out_like_learner_logprobs(grpo):
    _, _, response_mask = grpo.pad_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8]], 0, "cpu")
    out = grpo.behaviour_logprobs_tensor([[-0.1, -0.2], [-0.3, -0.4, -0.5]], response_mask)
    # token_logprobs position t holds the logprob of token t+1
    assert out.flatten().tolist() == pytest.approx([0, -0.1, -0.2, -0.3, -0.4, -0.5])


# ---------------------------------------------------------------- arithmetic generator
def recompute(question: str) -> int:
    total = int(re.match(r"\w+ has (\d+) ", question).group(1))
    for sentence in question.split(". Then ")[1:]:
        if m := re.search(r"gets (\d+) more", sentence):
            total += int(m.group(1))
        elif m := re.search(r"gives away (\d+) ", sentence):
            total -= int(m.group(1))
        else:
            total *= 2 if "doubles" in sentence else 3
    return total


@pytest.mark.parametrize("difficulty", [1, 2, 4])
def test_arithmetic_problems_are_seeded_correct_and_gsm8k_format(grpo, arithmetic, difficulty):
    problems = arithmetic.make_arithmetic_problems(200, difficulty, seed=5)
    assert problems == arithmetic.make_arithmetic_problems(200, difficulty, seed=5)
    assert problems != arithmetic.make_arithmetic_problems(200, difficulty, seed=6)
    for p in problems:
        answer = recompute(p["question"])
        assert answer >= 0 and p["answer"].endswith(f"\n#### {answer}")
        assert grpo.extract_answer(p["answer"]) == str(answer)
        assert p["question"].count(". Then ") == difficulty
        assert max(int(n) for n in re.findall(r"\d+", p["question"])) <= 10 * difficulty - 1


@pytest.mark.parametrize("difficulty", [1, 2])
def test_product_problems_are_one_seeded_product_the_verifier_grades(grpo, arithmetic, difficulty):
    """--kind products: one product of two factors of difficulty + 1 digits, none a multiple of 10; the test split
    is disjoint from the train split."""
    train, test = arithmetic.make_splits(difficulty, 300, 100, kind="products")
    assert (train, test) == arithmetic.make_splits(difficulty, 300, 100, kind="products")
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    for p in train + test:
        boxes, each = map(int, re.findall(r"\d+", p["question"]))
        assert all(10**difficulty <= n < 10 ** (difficulty + 1) and n % 10 for n in (boxes, each))
        assert grpo.extract_answer(p["answer"]) == str(boxes * each)
        assert f"{boxes} * {each} = {boxes * each}." in p["answer"]


def test_difficulty_changes_the_problems_and_the_eval_split_is_disjoint(grpo, arithmetic, arithmetic_folder):
    easy, hard = (arithmetic.make_arithmetic_problems(300, d, seed=0) for d in (1, 3))
    assert max(recompute(p["question"]) for p in easy) < max(recompute(p["question"]) for p in hard)
    assert any("doubles" in p["question"] or "triples" in p["question"] for p in hard)
    assert not any("doubles" in p["question"] or "triples" in p["question"] for p in easy)
    # the files the command line wrote, read as the GRPO script reads a --dataset-path folder
    args = grpo.RunArgs(dataset_path=str(arithmetic_folder))
    train, test = grpo.load_problems(args, "train"), grpo.load_problems(args, "test")
    assert (train, test) == arithmetic.make_splits(1, 7473, 1319)
    assert len(test) > 256 and not {p["question"] for p in train} & {p["question"] for p in test}


# ---------------------------------------------------------------- end to end
def run_ok(script, cwd, *flags):
    proc, seconds = run_script(script, cwd, *flags, "--output-dir", str(cwd / "model"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    evals = [json.loads(line) for line in next((cwd / "runs").glob("*/eval.jsonl")).read_text().splitlines()]
    return proc, read_metrics(cwd), evals, cwd


@pytest.fixture(scope="module")
def async_runs(tiny, arithmetic_folder, gsm8k_folder, tmp_path_factory):
    """K=1 on generated arithmetic problems and K=2 on a few GSM8K lines, 5 learner steps each."""
    runs = {}
    for name, k, data in (
        ("arith_k1", 1, ("--dataset-path", str(arithmetic_folder))),
        ("gsm8k_k2", 2, ("--dataset-path", str(gsm8k_folder))),
    ):
        cwd = tmp_path_factory.mktemp(name)
        runs[name] = run_ok(ASYNC, cwd, *common_flags(tiny, *data, "--num-learner-steps", "5", "--async-steps", str(k)))
    return runs


@pytest.mark.slow
def test_async_run_logs_metrics_evaluates_and_learns(async_runs, tiny):
    from transformers import AutoModelForCausalLM

    proc, metrics, evals, cwd = async_runs["arith_k1"]
    assert [m["step"] for m in metrics] == list(range(5))
    for key in (
        "objective/accuracy",
        "objective/format_rate",
        "losses/policy_loss",
        "policy/importance_ratio_mean",
        "policy/importance_ratio_max",
        "policy/clipfrac",
        "policy/approx_kl",
        "val/truncated_rate",
        "val/response_length",
        "time/generation",
        "time/reward_labeling",
        "time/training",
        "async/behaviour_learner_logprob_gap",
        "async/staleness",
    ):
        assert all(math.isfinite(m[key]) for m in metrics), key
    assert "objective/kl" not in metrics[0], "--kl-coef 0 must not load a reference"
    # the tiny policy solves a few problems: some groups have mixed rewards, so the policy gradient is not zero
    assert any(m["objective/zero_advantage_groups"] < 1 for m in metrics[:4])
    # every due version the generator held (0, 2; 4 is never loaded with K=1) and the final one, greedy
    assert [e["policy_version"] for e in evals] == [0, 2, 5]
    assert all(0 <= e["eval/accuracy"] <= 1 for e in evals)
    assert "eval accuracy of policy version 0:" in proc.stdout and "eval accuracy of policy version 5:" in proc.stdout
    assert "7473 training problems" in proc.stdout
    # the default micro-batch: all 64 sequences of the mini-batch fit the default budget, in one pass
    assert "micro-batch 64 of 64 sequences (est. " in proc.stdout
    trained = AutoModelForCausalLM.from_pretrained(cwd / "model")
    initial = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)


@pytest.mark.slow
def test_async_run_on_gsm8k_lines(async_runs):
    proc, metrics, evals, _ = async_runs["gsm8k_k2"]
    assert "16 training problems, 0 dropped" in proc.stdout and "8 held-out problems" in proc.stdout
    assert [e["policy_version"] for e in evals] == [0, 2, 5]
    assert metrics[-1]["episodes"] == 5 * 16 * 4


@pytest.mark.parametrize("name,k", [("arith_k1", 1), ("gsm8k_k2", 2)])
@pytest.mark.slow
def test_async_batches_come_from_exactly_version_step_minus_k(async_runs, name, k):
    metrics = async_runs[name][1]
    assert [m["async/actor_version"] for m in metrics] == [max(0, m["step"] - k) for m in metrics]
    assert [m["async/staleness"] for m in metrics] == [min(m["step"], k) for m in metrics]
    # at step 0 the learner and the engine hold the same (initial) weights
    assert metrics[0]["async/behaviour_learner_logprob_gap"] < 1e-4
    if name == "arith_k1":  # the policy moved (mixed groups), so K versions of staleness must show
        assert metrics[-1]["async/behaviour_learner_logprob_gap"] > 1e-3


@pytest.mark.slow
def test_paper_mode_ratio_is_exactly_one_at_the_first_update_however_stale(async_runs):
    metrics = async_runs["arith_k1"][1]  # the default correction, N = 1: each step's only update is its first
    assert metrics[-1]["async/behaviour_learner_logprob_gap"] > 1e-3
    for m in metrics:  # recomputed in the very micro-batches of the update: equal bit for bit
        assert m["policy/importance_ratio_max"] == 1.0 and m["policy/importance_ratio_mean"] == 1.0
        assert m["policy/clipfrac"] == 0.0 and m["policy/zero_gradient_frac"] == 0.0
        assert m["policy/importance_weight_mean"] == 1.0


@pytest.mark.parametrize(
    "name,data",
    [("arith", ("--dataset-path", "ARITHMETIC", "--num-mini-batches", "2")), ("gsm8k", ("--dataset-path", "GSM8K"))],
)
@pytest.mark.slow
def test_sync_baseline_generates_every_batch_with_the_current_policy(
    tiny, arithmetic_folder, gsm8k_folder, tmp_path, name, data
):
    folders = {"ARITHMETIC": str(arithmetic_folder), "GSM8K": str(gsm8k_folder)}
    data = tuple(folders.get(flag, flag) for flag in data)
    steps = 4 if name == "arith" else 2
    proc, metrics, evals, _ = run_ok(SYNC, tmp_path, *common_flags(tiny, *data, "--num-learner-steps", str(steps)))
    assert [m["async/actor_version"] for m in metrics] == list(range(steps))
    assert all(m["async/staleness"] == 0 for m in metrics)
    # the engine really runs the learner's current weights at every step
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-4 for m in metrics)
    assert [e["policy_version"] for e in evals] == ([0, 2, 4] if name == "arith" else [0, 2])
    if name == "arith":
        assert any(m["objective/zero_advantage_groups"] < 1 for m in metrics[:3]), "no gradient: proves nothing"
    assert (tmp_path / "model" / "config.json").exists()


# ---------------------------------------------------------------- failures
BAD_INPUTS = [
    (("--dataset-path", "./no/such/folder"), "--dataset-path './no/such/folder' must be a folder holding train.jsonl"),
    (("--prompt-template", "Q: {q}"), "--prompt-template must contain {question}"),
    (("--num-samples-per-prompt", "1"), "--num-samples-per-prompt must be >= 2"),
    (("--max-prompt-tokens", "2"), "no training problem is left"),
]


@pytest.mark.parametrize("script", [ASYNC, SYNC, "async_grpo_gsm8k_inflight.py"])
@pytest.mark.parametrize("flags,message", BAD_INPUTS)
def test_bad_input_fails_with_one_message_before_the_engine_starts(
    tiny, arithmetic_folder, tmp_path, cli, script, flags, message
):
    proc = cli(
        script,
        tmp_path,
        *common_flags(tiny, "--dataset-path", str(arithmetic_folder), "--num-learner-steps", "2"),
        *flags,
    )
    assert proc.returncode != 0
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Initializing a V1 LLM engine" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_the_run_ends_with_a_summary_naming_real_files_and_the_plot_command_works(async_runs):
    """The quickstart path: the summary's numbers come from the run's logs; every path or command it prints works."""
    proc, metrics, evals, cwd = async_runs["arith_k1"]
    summary = proc.stdout[proc.stdout.index("== async_grpo_gsm8k__") :].splitlines()
    assert re.match(
        r"== async_grpo_gsm8k__3__\d+: 5 learner steps, 320 episodes, [\d.]+ min \(idle: learner \d+%, "
        r"generation \d+%\)$",
        summary[0],
    ), summary[0]
    assert summary[1] == (
        f"objective/accuracy: {metrics[0]['objective/accuracy']:.3f} at step 0 -> "
        f"{metrics[-1]['objective/accuracy']:.3f} at step 4"
    )
    assert summary[2] == (
        f"eval/accuracy (greedy, held-out): {evals[0]['eval/accuracy']:.3f} at policy version 0 -> "
        f"{evals[-1]['eval/accuracy']:.3f} at version 5"
    )
    fields = dict(line.split(":", 1) for line in summary[3:])
    assert (cwd / fields["model"].strip() / "config.json").exists()
    assert all((cwd / path.strip()).stat().st_size > 0 for path in fields["metrics"].split(","))
    run_dir = cwd / fields["tensorboard"].split("--logdir")[1].strip()
    assert list(run_dir.glob("events.out.tfevents.*"))
    # the printed plot command, run from the repository root, with the other run beside it (two lines per panel)
    command = fields["plot"].split()
    assert command[:2] == ["python", "tools/plot_runs.py"]
    other = next((async_runs["gsm8k_k2"][3] / "runs").iterdir())
    out = cwd / "compare.png"
    plot = subprocess.run(
        [sys.executable, command[1], str(cwd / command[2]), str(other), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert plot.returncode == 0, plot.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # a folder that is not a run fails with one line naming it
    bad = subprocess.run([sys.executable, "tools/plot_runs.py", str(cwd)], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.strip() == f"error: {cwd} is not a run folder (no metrics.jsonl there)"
