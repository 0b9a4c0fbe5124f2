"""benchmark/staleness.py: the --quick mode runs the whole miniature pipeline (prep, sweep runs, evaluation, report)
end to end, and a rerun skips finished runs."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import load_script, run_script


@pytest.mark.slow
def test_staleness_quick_mode_writes_results_table_and_plot(tmp_path):
    results, work = tmp_path / "results", tmp_path / "work"
    flags = ("--quick", "--algorithms", "dpo", "--results-dir", str(results), "--work-dir", str(work))
    proc, _ = run_script("benchmark/staleness.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # the prep: data files, an SFT policy, and its measured numbers
    prep = json.loads((results / "runs" / "prep.json").read_text())
    for key in ("sft_greedy_accuracy",):
        assert 0 <= prep[key] <= 1, key
    for key in ("policy_parameters", "total_seconds"):
        assert prep[key] > 0, key
    assert (work / "sft" / "config.json").exists() and not (work / "rm").exists()  # every run trains on the verifier
    test_questions = {json.loads(line)["question"] for line in (work / "data" / "test.jsonl").read_text().splitlines()}
    train_questions = {
        json.loads(line)["question"] for line in (work / "data" / "train.jsonl").read_text().splitlines()
    }
    assert test_questions and not test_questions & train_questions  # the held-out set is disjoint

    # one result file per run, each a curve evaluated at the same update counts, with finite numbers and the same
    # episode budget for every setting
    names = sorted(p.name for p in (results / "runs").glob("*__*__seed*.json"))
    assert names == [
        "dpo__async-1__lr0.0001__seed1.json",
        "dpo__sync-1__lr0.0001__seed1.json",
        "dpo__sync-2__lr0.0001__seed1.json",
    ]
    runs = [json.loads((results / "runs" / n).read_text()) for n in names]
    for r in runs:
        assert [p["updates"] for p in r["curve"]] == [0, 2, 4]
        for p in r["curve"]:
            assert 0 <= p["gold_reward"] <= 1 and 0 <= p["greedy_accuracy"] <= 1 and math.isfinite(p["kl"]), r
        assert r["curve"][0]["kl"] == 0.0  # the SFT policy against itself
        assert r["gold_reward"] == r["curve"][-1]["gold_reward"]
    assert len({r["episodes"] for r in runs}) == 1
    assert not list((work / "runs").glob("*.claim"))  # every claim is released once its run is done
    # how off-policy the data were, from each run's own metrics: async-1's engine lags one version behind the learner
    gaps = {r["setting"]: r["off_policy"]["logprob_gap_max"] for r in runs}
    assert gaps["sync-1"] < 1e-4 and gaps["async-1"] > gaps["sync-1"], gaps
    assert all(r["off_policy"]["importance_ratio_max"] is None for r in runs)  # DPO has no ratio
    # the paper's protocol: the same mini-batch and number of updates, sync-N generating N mini-batches per round, and
    # a checkpoint every 2 updates; every run trains on the verifier
    flag = lambda r, name: r["command"][r["command"].index(name) + 1]
    assert [
        (int(flag(r, "--prompts-per-step")), int(flag(r, "--num-learner-steps")), int(flag(r, "--save-every")))
        for r in runs
    ] == [(2, 4, 2), (2, 4, 2), (4, 2, 1)]
    assert flag(runs[2], "--num-mini-batches") == "2" and flag(runs[0], "--async-steps") == "1"
    assert all(flag(r, "--reward") == "verifier" and flag(r, "--keep-checkpoints") == "0" for r in runs)  # DPO

    # the report: one table row per setting, with finite numbers, the rate-sweep table, and the two plots
    table = (results / "staleness.md").read_text()
    main_table = table.split("What staleness costs")[0]
    rows = [line for line in main_table.splitlines() if line.startswith("| dpo | ") and "sync" in line.split("|")[2]]
    assert [r.split("|")[2].strip() for r in rows] == ["sync-1", "async-1", "sync-2"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(math.isfinite(float(cells[i].split(" ")[0])) for i in (2, 3, 4, 5, 6)) and cells[7] == "1", row
    assert "| dpo | 0.0001 * |" in table
    assert "| dpo | async-1 | " in table.split("How far off-policy")[1]
    for name in ("staleness.png", "staleness_updates.png"):
        assert (results / name).stat().st_size > 1000

    # a rerun skips every finished run (and the prep), then rebuilds the report
    (results / "staleness.md").unlink()
    again, _ = run_script("benchmark/staleness.py", tmp_path, *flags, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count("done already") == 3 and "[prep" not in again.stdout
    assert (results / "staleness.md").read_text() == table

    # finished runs of another budget are refused, not reused (a silent mix would corrupt the table)
    longer, _ = run_script(
        "benchmark/staleness.py", tmp_path, *flags, "--settings", "sync-1", "--num-updates", "8", timeout=900
    )
    assert longer.returncode != 0
    assert "dpo__sync-1__lr0.0001__seed1.json was made with" in longer.stderr
    assert "'--num-learner-steps': 4" in longer.stderr

    # so is a cached prep built with other prep flags
    other_prep, _ = run_script("benchmark/staleness.py", tmp_path, *flags, "--sft-target-accuracy", "0.9", timeout=900)
    assert other_prep.returncode != 0
    assert "was built with" in other_prep.stderr and "'sft_target_accuracy': 0.2" in other_prep.stderr


def test_settings_and_gold_at_matched_kl():
    """The sweep's settings (DPO has no correction modes) and the interpolation behind "gold at matched KL"."""
    staleness = load_script("benchmark/staleness.py")
    assert staleness.settings_of("dpo") == [
        "sync-1",
        "sync-4",
        "sync-16",
        "sync-32",
        "async-1",
        "async-2",
        "async-4",
        "async-8",
    ]
    rloo = staleness.settings_of("rloo")
    assert len(rloo) == 4 + 4 * 3 and "async-8-decoupled" in rloo and "async-8" not in rloo
    assert staleness.setting_flags("async-4-behaviour") == (
        "async_script",
        1,
        ["--async-steps", "4", "--off-policy-correction", "behaviour"],
    )
    assert staleness.setting_flags("sync-16") == ("sync_script", 16, ["--num-mini-batches", "16"])
    curve = [
        dict(kl=0.0, gold_reward=0.2),
        dict(kl=1.0, gold_reward=0.4),
        dict(kl=0.8, gold_reward=0.3),
        dict(kl=3.0, gold_reward=0.5),
    ]
    assert staleness.gold_at_kl(curve, 0.5) == pytest.approx(0.3)  # halfway along the first segment
    # 2.0 is first reached on the 0.8 -> 3.0 leg
    assert staleness.gold_at_kl(curve, 2.0) == pytest.approx(0.3 + (1.2 / 2.2) * 0.2)
    assert math.isnan(staleness.gold_at_kl(curve, 4.0))  # never reached


def test_cost_tables_pair_seeds_rank_by_the_most_stale_settings_and_compare_corrections():
    """The cost of a setting is its late gold (the mean of the last 3 evaluations) minus sync-1's of the same seed; the
    ranking uses RANKED, async under the paper's loss; an algorithm missing one of them is not ranked."""
    staleness = load_script("benchmark/staleness.py")
    gold = {  # (algorithm, setting): late gold of seeds 1 and 2
        ("dpo", "sync-1"): (0.30, 0.20),
        ("dpo", "sync-16"): (0.29, 0.19),
        ("dpo", "sync-32"): (0.28, 0.18),
        ("dpo", "async-4"): (0.30, 0.20),
        ("dpo", "async-8"): (0.29, 0.19),
        ("rloo", "sync-1"): (0.30, 0.30),
        ("rloo", "sync-16"): (0.20, 0.22),
        ("rloo", "sync-32"): (0.10, 0.10),
        ("rloo", "async-4-paper"): (0.20, 0.20),
        ("rloo", "async-8-paper"): (0.10, 0.10),
        ("rloo", "async-8-behaviour"): (0.25, 0.27),
        ("rloo", "async-8-decoupled"): (0.30, 0.32),
        ("ppo", "sync-1"): (0.30, 0.30),
        ("ppo", "sync-16"): (0.30, 0.30),  # incomplete: not ranked
    }
    # four evaluations, the last three around the late gold; the final gold equals it but for one run
    curve = lambda g: [
        dict(updates=u, gold_reward=x) for u, x in zip((0, 32, 64, 96), (0.0, g - 0.02, g + 0.01, g + 0.01))
    ]
    runs = {
        key: [dict(seed=seed, gold_reward=g + 0.01, curve=curve(g)) for seed, g in zip((1, 2), golds)]
        for key, golds in gold.items()
    }
    runs[("dpo", "sync-32")][0]["gold_reward"] = 0.21  # final gold alone: -0.10 against sync-1's 0.31, not -0.02
    prep = dict(flags=dict(num_eval_problems=256, eval_samples=4))
    lines = staleness.cost_tables(runs, prep)
    row = lambda start: next(line for line in lines if line.startswith(start)).strip("|").split("|")
    dpo, rloo, ppo = row("| dpo |"), row("| rloo |"), row("| ppo |")
    # columns: algorithm, sync-1 late gold, sync-4, sync-16, sync-32, async-1, async-2, async-4, async-8, mean cost,
    # mean cost on the final gold, rank
    assert dpo[1].strip() == "0.250" and dpo[3].strip() == "-0.010 ± 0.000" and dpo[2].strip() == "–"
    assert rloo[3].strip() == "-0.090 ± 0.014"  # per-seed differences -0.10 and -0.08
    # the mean cost, ± the std of each seed's own mean cost: rloo's seeds -0.15 and -0.145
    assert dpo[9].strip() == "-0.010 ± 0.000" and rloo[9].strip() == "-0.147 ± 0.004"
    assert float(dpo[10]) == pytest.approx(-0.020, abs=1e-3)  # sync-32's final-gold cost: mean(-0.10, -0.02)
    assert (dpo[11].strip(), rloo[11].strip(), ppo[11].strip()) == ("1", "2", "(incomplete)")
    assert any("updates 32, 64, 96" in line for line in lines)
    k8 = row("| rloo | 8 |")
    assert [c.strip() for c in k8[2:5]] == ["-0.200 ± 0.000", "-0.040 ± 0.014", "+0.010 ± 0.014"]
    assert any("1,024 samples" in line for line in lines)


def test_a_claimed_run_is_left_to_its_claimant_until_that_process_is_gone(tmp_path):
    """Two invocations sharing a sweep never run the same run: the second sees the first's claim and skips the run;
    a claim left by a killed invocation is taken over."""
    common = load_script("benchmark/common.py")  # the staleness sweeps' claims
    stem = "dpo__sync-1__lr0.0001__seed1"
    mine = common.claim(tmp_path, stem)
    assert mine == tmp_path / "runs" / f"{stem}.claim" and mine.read_text() == str(os.getpid())
    assert common.claim(tmp_path, stem) is None  # held by a live process (this one)
    assert common.claim(tmp_path, "dpo__sync-4__lr0.0001__seed1") is not None  # other runs are free
    mine.unlink()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mine.write_text(gone.stdout.strip())  # the claim of an invocation that was killed
    assert common.claim(tmp_path, stem) == mine and mine.read_text() == str(os.getpid())


def test_sampler_and_kl_match_the_scripts_logprobs(tmp_path):
    """The evaluation's own sampler stops at EOS, and its logprob sums equal the scripts' `token_logprobs` summed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    staleness, dpo = load_script("benchmark/staleness.py"), load_script("async_dpo.py")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=64,
        )
    ).eval()
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    responses = staleness.sample(model, prompts, 2, 0.7, 6, eos_id=0, seed=0)
    assert len(responses) == 6 and all(0 < len(r) <= 6 and 0 not in r[:-1] for r in responses)
    assert staleness.sample(model, prompts, 2, 0.7, 6, 0, seed=0) == responses  # seeded
    repeated = [p for p in prompts for _ in range(2)]
    sums = staleness.response_logprob_sums(model, repeated, responses, 0.7, pad_id=0)
    ids, mask, rmask = dpo.pad_sequences(repeated, responses, 0, "cpu")
    with torch.no_grad():
        expected = dpo.token_logprobs(model, ids, mask, rmask, 0.7).sum(1)
    torch.testing.assert_close(torch.tensor(sums), expected, rtol=1e-5, atol=1e-5)
