"""benchmark/staleness_paper.py: the paper's protocol in miniature. The --quick mode runs the whole pipeline (SFT prep,
gold-labelled pairs, Bradley-Terry proxy reward model, sweep runs on the scripts' `--reward model` path, evaluation,
report); the pieces of the metric are checked against hand-computed values."""

import json
import math
import sys

import pytest

from conftest import REPO, load_script, run_script

sys.path.insert(0, str(REPO / "tools"))
import make_arithmetic  # noqa: E402


def test_paper_protocol_quick_mode_trains_on_the_proxy_and_reports_win_rate_against_kl(tmp_path):
    results, work = tmp_path / "results", tmp_path / "work"
    flags = ("--quick", "--algorithms", "rloo", "--results-dir", str(results), "--work-dir", str(work))
    proc, _ = run_script("benchmark/staleness_paper.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # the prep: the SFT policy, a reward model with the policy's tokenizer, trained on untied gold-labelled pairs
    prep = json.loads((results / "staleness_paper" / "prep.json").read_text())
    assert prep["rm_pairs"] + prep["rm_tied_pairs"] == 128  # 128 problems x 2 samples, one disjoint pair each
    assert prep["rm_pairs"] > 0 and 0 <= prep["rm_test_pair_accuracy"] <= 1
    assert prep["missing_eos_penalty"] == pytest.approx(prep["rm_score_mean"] - 2.0, abs=0.01)
    assert (work / "rm" / "config.json").exists() and (work / "rm" / "tokenizer.json").exists()
    queries = [json.loads(line) for line in (work / "prompts" / "train.jsonl").read_text().splitlines()]
    assert len(queries) == 128 and queries[0]["query"].startswith("Question: ")

    # one result file per run (RLOO's async setting names its correction), each a curve from the SFT policy on
    names = sorted(p.name for p in (results / "staleness_paper").glob("*__seed*.json"))
    assert names == ["rloo__async-1-paper__lr0.0001__seed1.json", "rloo__sync-1__lr0.0001__seed1.json",
                     "rloo__sync-2__lr0.0001__seed1.json"]
    runs = [json.loads((results / "staleness_paper" / n).read_text()) for n in names]
    flag = lambda r, name: r["command"][r["command"].index(name) + 1]
    for r in runs:
        assert [p["updates"] for p in r["curve"]] == [0, 2, 4]
        assert r["curve"][0]["kl"] == 0.0  # the SFT policy against itself
        for p in r["curve"]:
            assert 0 <= p["win_rate"] <= 1 and 0 <= p["gold"] <= 1 and math.isfinite(p["proxy"]), p
        # every run optimises the proxy through the script's reward-model path, with the paper's 2 samples per prompt
        assert flag(r, "--reward") == "model" and flag(r, "--reward-model-path") == str(work / "rm")
        assert flag(r, "--num-samples-per-prompt") == "2"
        assert float(flag(r, "--missing-eos-penalty")) == prep["missing_eos_penalty"]
        assert len(r["train_scores"]) == int(flag(r, "--num-learner-steps"))
    # the SFT policy is evaluated on the same draws in every run: update 0 is the same point everywhere
    assert len({json.dumps(r["curve"][0]) for r in runs}) == 1

    # the report: the gate table, a shortfall row per off-policy setting, and both plots
    table = (results / "staleness_paper.md").read_text()
    assert "| rloo | 0.0001 * | 1 |" in table
    for setting in ("sync-2", "async-1-paper"):
        row = next(line for line in table.splitlines() if line.startswith(f"| rloo | {setting} |"))
        assert math.isfinite(float(row.split("|")[3].split()[0])), row
    for name in ("staleness_paper.png", "staleness_paper_gate.png"):
        assert (results / name).stat().st_size > 1000

    # a rerun skips every finished run and the prep
    again, _ = run_script("benchmark/staleness_paper.py", tmp_path, *flags, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "== rloo" not in again.stdout and "[prep" not in again.stdout
    assert (results / "staleness_paper.md").read_text() == table


def test_gold_score_gives_partial_credit_by_distance_and_a_format_term():
    gold = make_arithmetic.gold_score
    assert gold("Ava starts with 3.\n#### 7", "7") == pytest.approx(1.0)
    assert gold("#### 8", "7") == pytest.approx(0.8 / 2 + 0.2)  # one off, formatted
    assert gold("so 5", "7") == pytest.approx(0.8 / 3)  # two off, no "#### n" ending
    assert gold("#### 7 apples", "7") == pytest.approx(0.8)  # exact, but not the taught ending
    assert gold("no number", "7") == 0.0
    # the binary grader is the exact-answer part of the gold
    for text in ("#### 7", "#### 8", "the answer is 7", "none"):
        assert make_arithmetic.grade(text, "7") == float(gold(text, "7") >= 0.8)


def test_win_rate_shortfall_and_confidence_interval():
    paper = load_script("benchmark/staleness_paper.py")
    # 2 prompts, n = 2 policy samples and m = 2 SFT samples each: prompt 1 wins 1 + 0.5 + 1 + 1, prompt 2 wins 0 + 0.5
    assert paper.win_rate([0.9, 0.6, 0.2, 0.4], [0.6, 0.3, 0.4, 0.8], 2, 2) == pytest.approx((3.5 + 0.5) / 8)
    # sync-1 rises linearly from 0.5 to 0.7 over KL 0..2; the setting lies 0.05 below it everywhere
    reference = [dict(kl=0.0, win_rate=0.5), dict(kl=2.0, win_rate=0.7)]
    lower = [dict(kl=0.0, win_rate=0.45), dict(kl=1.0, win_rate=0.55), dict(kl=3.0, win_rate=0.75)]
    assert paper.shortfall(lower, reference, 2.0) == pytest.approx(0.05)
    assert paper.reach(lower) == 3.0
    m, half = paper.mean_ci([0.1, 0.2, 0.3])
    assert m == pytest.approx(0.2) and half == pytest.approx(4.30 * 0.1 / math.sqrt(3))  # t(2) = 4.30
    assert paper.settings_of("dpo") == ["sync-1", "sync-4", "sync-16", "sync-32", "async-1", "async-4", "async-8"]
    assert paper.settings_of("ppo")[-1] == "async-8-behaviour" and len(paper.settings_of("ppo")) == 10
    assert paper.runnable("rloo", "async-1-paper") and not paper.runnable("rloo", "async-1")
    assert paper.runnable("dpo", "async-1") and not paper.runnable("dpo", "async-1-paper")


def test_scores_pair_each_setting_with_the_same_seed_of_sync_1_over_the_common_kl_range():
    paper = load_script("benchmark/staleness_paper.py")
    line = lambda top, slope: [dict(kl=0.0, win_rate=0.5), dict(kl=top, win_rate=0.5 + slope * top)]
    runs = {("rloo", "sync-1"): [dict(seed=1, curve=line(4.0, 0.10)), dict(seed=2, curve=line(4.0, 0.05))],
            ("rloo", "sync-16"): [dict(seed=2, curve=line(2.0, 0.05)), dict(seed=1, curve=line(3.0, 0.00))]}
    kl_max, scores = paper.scores_of(runs, "rloo")
    assert kl_max == 2.0  # the smallest reach of any run
    # seed 1: 0.10 * kl below its sync-1, mean over the grid of (0, 2] = 0.10 * 1.05; seed 2: the same line, 0
    assert scores["sync-16"] == pytest.approx([0.0, 0.10 * 1.05])


def test_report_pairs_the_two_corrections_by_seed(tmp_path):
    """The report's last table: at each K, `behaviour`'s shortfall minus `paper`'s, seed by seed (same samples of
    prompts, same sync-1 run), so a difference smaller than the seeds' spread can still be told apart."""
    import json

    paper = load_script("benchmark/staleness_paper.py")
    (tmp_path / "staleness_paper").mkdir()

    def write(setting, seed, below):  # a straight win-rate curve over KL 0..4, `below` under sync-1's
        curve = [dict(updates=u, kl=u / 2, win_rate=0.5 + 0.05 * u / 2 - below, gold=0.6, proxy=0.0) for u in range(9)]
        (tmp_path / "staleness_paper" / f"rloo__{setting}__lr0.0001__seed{seed}.json").write_text(json.dumps(
            dict(algorithm="rloo", setting=setting, learning_rate=paper.LEARNING_RATE, seed=seed, curve=curve)))

    for seed, (paper_below, behaviour_below) in {1: (0.02, 0.01), 2: (0.04, 0.01), 3: (0.03, 0.03)}.items():
        write("sync-1", seed, 0.0)
        write("async-8-paper", seed, paper_below)
        write("async-8-behaviour", seed, behaviour_below)
    paper.report(tmp_path)
    table = (tmp_path / "staleness_paper.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| rloo | 8 |"))
    m, half = paper.mean_ci([-0.01, -0.03, 0.0])
    assert row == f"| rloo | 8 | {m:+.3f} ± {half:.3f} | 3 |" and m == pytest.approx(-0.0133, abs=1e-4)


def test_reward_model_is_read_where_the_scripts_read_it():
    """The prep trains and evaluates the proxy at the position the scripts' `get_scores` reads (the last real token)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    paper, dpo = load_script("benchmark/staleness_paper.py"), load_script("async_dpo.py")
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=64, num_labels=1, pad_token_id=0)).eval()
    prompts, responses = [[1, 2, 3], [4, 5], [6]], [[7, 0], [8, 9, 10, 0], [11]]
    ids, mask, _ = dpo.pad_sequences(prompts, responses, 0, "cpu")
    with torch.no_grad():
        expected = dpo.get_scores(rm, ids, mask, micro_batch_size=2)
        torch.testing.assert_close(paper.rm_scores(rm, prompts, responses, pad_id=0), expected)
        # the missing-EOS penalty replaces the score of the response without EOS, as in training
        proxy = paper.proxy_rewards(rm, prompts, responses, eos_id=0, penalty=-5.0, pad_id=0)
    assert proxy[2] == -5.0 and proxy[:2] == pytest.approx(expected[:2].tolist())
