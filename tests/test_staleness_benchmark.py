"""benchmark/staleness.py: the --quick mode runs the whole miniature pipeline (prep, sweep runs, evaluation, report)
end to end, and a rerun skips finished runs."""

import json
import math

from conftest import load_script, run_script


def test_staleness_quick_mode_writes_results_table_and_plot(tmp_path):
    results, work = tmp_path / "results", tmp_path / "work"
    flags = ("--quick", "--algorithms", "dpo", "--results-dir", str(results), "--work-dir", str(work))
    proc, _ = run_script("benchmark/staleness.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # the prep: data files, an SFT policy and a reward model, and its measured numbers
    prep = json.loads((results / "staleness" / "prep.json").read_text())
    for key in ("sft_greedy_accuracy", "rm_heldout_accuracy"):
        assert 0 <= prep[key] <= 1, key
    for key in ("policy_parameters", "rm_parameters", "total_seconds"):
        assert prep[key] > 0, key
    assert (work / "sft" / "config.json").exists() and (work / "rm" / "config.json").exists()
    test_questions = {json.loads(line)["question"] for line in (work / "data" / "test.jsonl").read_text().splitlines()}
    train_questions = {json.loads(line)["question"]
                       for line in (work / "data" / "train.jsonl").read_text().splitlines()}
    assert test_questions and not test_questions & train_questions  # the held-out set is disjoint

    # one result file per run, with finite numbers and the same episode budget for every setting
    names = sorted(p.name for p in (results / "staleness").glob("*__*__seed*.json"))
    assert names == ["dpo__async-1__seed1.json", "dpo__sync-1__seed1.json", "dpo__sync-2__seed1.json"]
    runs = [json.loads((results / "staleness" / n).read_text()) for n in names]
    for r in runs:
        assert 0 <= r["gold_reward"] <= 1 and 0 <= r["greedy_accuracy"] <= 1 and math.isfinite(r["kl"]), r
    assert len({r["episodes"] for r in runs}) == 1
    # the paper's protocol: the same mini-batch and number of updates, sync-N generating N mini-batches per round
    flag = lambda r, name: int(r["command"][r["command"].index(name) + 1])
    assert [(flag(r, "--prompts-per-step"), flag(r, "--num-learner-steps")) for r in runs] == [(2, 2), (2, 2), (4, 1)]
    assert "--num-mini-batches" in runs[2]["command"] and "--async-steps" in runs[0]["command"]

    # the report: one table row per setting, with finite numbers, and a plot
    table = (results / "staleness.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| dpo |")]
    assert [r.split("|")[2].strip() for r in rows] == ["sync-1", "sync-2", "async-1"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(math.isfinite(float(cells[i].split(" ")[0])) for i in (2, 3, 4)) and cells[5] == "1", row
    assert (results / "staleness.png").stat().st_size > 1000

    # a rerun skips every finished run (and the prep), then rebuilds the report
    (results / "staleness.md").unlink()
    again, _ = run_script("benchmark/staleness.py", tmp_path, *flags, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count("done already") == 3 and "[prep" not in again.stdout
    assert (results / "staleness.md").read_text() == table

    # finished runs of another budget are refused, not reused (a silent mix would corrupt the table)
    longer, _ = run_script("benchmark/staleness.py", tmp_path, *flags, "--settings", "sync-1",
                           "--num-updates", "4", timeout=900)
    assert longer.returncode != 0
    assert "dpo__sync-1__seed1.json was made with" in longer.stderr and "'--num-learner-steps': 2" in longer.stderr

    # so is a cached prep built with other prep flags
    other_prep, _ = run_script("benchmark/staleness.py", tmp_path, *flags, "--rm-epochs", "2", timeout=900)
    assert other_prep.returncode != 0
    assert "was built with" in other_prep.stderr and "'rm_epochs': 1" in other_prep.stderr


def test_sampler_and_kl_match_the_scripts_logprobs(tmp_path):
    """The evaluation's own sampler stops at EOS, and its logprob sums equal the scripts' `token_logprobs` summed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    staleness, dpo = load_script("benchmark/staleness.py"), load_script("async_dpo.py")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=64)).eval()
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
