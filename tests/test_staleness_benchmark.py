"""benchmark/staleness.py, the miniature task the staleness sweeps share: its settings and budgets, its held-out
set, its prep cache, its sampler and KL; and the sweeps' claims (benchmark/common.py)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import load_script


def test_settings_name_the_script_the_flags_and_the_paper_s_budget():
    """sync-N runs the sync twin with N mini-batches per round and 1/N as many rounds; async-K the async script with
    K versions of lag under its correction; every setting makes the same updates of the same mini-batch."""
    staleness = load_script("benchmark/staleness.py")
    assert staleness.parse_setting("async-2-decoupled") == ("async", 2, "decoupled")
    assert staleness.setting_flags("async-4-behaviour") == (
        "async_script",
        1,
        ["--async-steps", "4", "--off-policy-correction", "behaviour"],
    )
    assert staleness.setting_flags("async-4") == ("async_script", 1, ["--async-steps", "4"])  # DPO: no correction
    assert staleness.setting_flags("sync-16") == ("sync_script", 16, ["--num-mini-batches", "16"])
    args = SimpleNamespace(mini_batch_prompts=16, num_updates=512, eval_every_updates=64, response_length=48)
    assert staleness.budget(args, "sync-16") == {
        "--prompts-per-step": 256,
        "--num-learner-steps": 32,
        "--response-length": 48,
        "--save-every": 4,
    }
    assert staleness.budget(args, "sync-128")["--save-every"] == 1  # a round longer than an evaluation period
    assert staleness.budget(args, "async-8-paper")["--num-learner-steps"] == 512


def test_held_out_problems_are_disjoint_and_a_prep_of_other_flags_is_refused(tmp_path):
    """The held-out questions never appear in training; a cached prep built with other flags stops the invocation in
    one line instead of being reused."""
    staleness, common = load_script("benchmark/staleness.py"), load_script("benchmark/common.py")
    task = common.arithmetic_task()
    args = SimpleNamespace(
        difficulty=1,
        num_train_problems=200,
        num_eval_problems=50,
        sft_max_steps=10,
        sft_target_accuracy=0.2,
        eval_samples=2,
        response_length=32,
        work_dir=str(tmp_path),
    )
    train, test = staleness.make_data(args, task, tmp_path / "data")
    assert len(test) == 50 and not {p["question"] for p in test} & {p["question"] for p in train}
    assert (tmp_path / "data" / "test.jsonl").read_text().count("\n") == 50
    (tmp_path / "prep.json").write_text(json.dumps(dict(flags=dict(sft_target_accuracy=0.9))))
    with pytest.raises(SystemExit, match="was built with .*'sft_target_accuracy': 0.9"):
        staleness.prepare(args, task)


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
