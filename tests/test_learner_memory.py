"""The paper's own configurations: micro-batches with gradient accumulation, memory-lean logprobs, gradient
checkpointing, bfloat16 autocast, and GPT-NeoX (Pythia's architecture, which vLLM 0.32 serves through its
Transformers backend) end to end.

The helpers are identical in the four async scripts (tests/test_twins.py), so testing one copy covers all of them; the
training loops are not, so the micro-batch equality is checked end to end for every algorithm.
"""

from pathlib import Path

import pytest
import torch

from conftest import load_script, read_metrics, run_script


@pytest.fixture(scope="module")
def dpo():
    return load_script("async_dpo.py")


def batch(tokenizer, prompts, responses, dpo):
    ids = [tokenizer(p).input_ids for p in prompts], [tokenizer(r).input_ids for r in responses]
    return dpo.pad_sequences(*ids, tokenizer.pad_token_id, "cpu")


def plain_token_logprobs(model, input_ids, attention_mask, response_mask, temperature):
    """The textbook computation, over every position: log_softmax of the full logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1) * response_mask[:, 1:]


@pytest.mark.parametrize("architecture", ["policy", "neox_policy"])
def test_token_logprobs_equal_a_plain_log_softmax_and_so_do_their_gradients(dpo, tiny, architecture):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / architecture)
    model = AutoModelForCausalLM.from_pretrained(tiny / architecture, dtype=torch.float32).eval()
    # prompts of different lengths: logits are kept only from the first response column of the batch on
    ids, attn, resp = batch(
        tokenizer,
        ["Natalia sold clips to 48 of her friends in April", "How many"],
        [" she sold 24", " apples are left now"],
        dpo,
    )
    ours = dpo.token_logprobs(model, ids, attn, resp, 0.7)
    ours.sum().backward()
    ours_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = plain_token_logprobs(model, ids, attn, resp, 0.7)
    plain.sum().backward()
    assert ours.shape == plain.shape and (ours != 0).sum() == resp[:, 1:].sum()
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=1e-5)
    for a, p in zip(ours_grad, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(dpo, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / "neox_policy")
    ids, attn, resp = batch(tokenizer, ["Natalia sold clips", "How many apples"], [" to 48 friends", " are left"], dpo)
    results = []
    for checkpointing in (False, True):
        # dropout that would change the result if training mode left it on
        model = AutoModelForCausalLM.from_pretrained(
            tiny / "neox_policy", dtype=torch.float32, hidden_dropout=0.5, attention_dropout=0.5
        ).eval()
        if checkpointing:
            dpo.enable_gradient_checkpointing(model)
            assert model.training and model.is_gradient_checkpointing
        logprobs = dpo.token_logprobs(model, ids, attn, resp, 0.7)
        logprobs.sum().backward()
        results.append((logprobs.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bfloat16_autocast_runs_the_learner_in_bfloat16_with_float32_weights(dpo, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / "policy")
    model = AutoModelForCausalLM.from_pretrained(tiny / "policy", dtype=torch.float32).eval()
    ids, attn, resp = batch(tokenizer, ["Natalia sold clips"], [" to 48 of her friends"], dpo)
    args = dpo.RunArgs(learner_device="cpu", learner_dtype="bfloat16")
    with dpo.learner_autocast(args):
        low = dpo.token_logprobs(model, ids, attn, resp, 0.7)
    full = dpo.token_logprobs(model, ids, attn, resp, 0.7)
    low.sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert 0 < (low - full).abs().max() < 0.2  # bfloat16 matmuls: close, but not float32-equal


def test_the_default_micro_batch_is_the_whole_mini_batch_when_it_fits_the_memory_budget(dpo, tiny, capsys):
    """--micro-batch-size None: the whole mini-batch under a large budget, the most sequences that fit under a small
    one (at least 1), on CPU and GPU alike; an explicit size always wins. One printed line gives the choice and the estimate."""

    def choose(sequences=16, length=100, **flags):
        args = dpo.RunArgs(model_name_or_path=str(tiny / "policy"), learner_device=flags.pop("device", "cpu"), **flags)
        args.micro_batch_size = dpo.choose_micro_batch_size(args, sequences, length)
        return args.micro_batch_size, capsys.readouterr().out.strip()

    # the tiny Llama (L 2, h 128, I 256, V 512): per token 2 layers x 1.27 (48 h + 16 I) bytes, plus 4 x 4 V bytes
    per_sequence = 100 * (2 * 1.27 * (48 * 128 + 16 * 256) + 16 * 512) / 2**30
    assert choose() == (16, "micro-batch 16 of 16 sequences (est. 0.05 GiB of --micro-batch-memory-gib 4)")
    assert choose(micro_batch_memory_gib=5.5 * per_sequence)[0] == 5
    assert choose(micro_batch_memory_gib=per_sequence / 10)[0] == 1
    assert choose(length=20, micro_batch_memory_gib=5.5 * per_sequence)[0] == 16  # shorter sequences: all fit again
    assert choose(micro_batch_size=3, micro_batch_memory_gib=0.001) == (
        3,
        "micro-batch 3 of 16 sequences (est. 0.01 GiB of --micro-batch-memory-gib 0.001)",
    )
    # on a GPU the core keeps the same budget (issue 44: a constant 8 did not fit Pythia-2.8b); the variant sizes it
    assert choose(micro_batch_memory_gib=5.5 * per_sequence, device="cuda:1")[0] == 5
    assert choose(micro_batch_size=32, device="cuda:1")[0] == 32


def test_the_multigpu_variant_sizes_the_gpu_micro_batch_from_free_memory_less_the_models(tiny, capsys, monkeypatch):
    """Issue 44: with no --micro-batch-memory-gib, a learner GPU's budget is 90% of its free memory less 16 bytes per
    trained parameter (+4 for DDP's buckets), 4 for the reference, all over the ranks under FSDP2, and beside the engine
    the reward model and vLLM's share; a sequence that does not fit even alone is refused in one line. The device
    query is the one thing replaced (no GPU here): free and total memory of an 80 GiB card."""
    variant = load_script("multigpu/async_dpo_multigpu.py")
    free, total = 79.0 * 2**30, 80.0 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    size = sum(
        p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny / "policy").parameters()
    )
    config = variant.model_config("--model-name-or-path", str(tiny / "policy"))

    def budget(**flags):
        args = variant.RunArgs(
            model_name_or_path=str(tiny / "policy"), **{"engine_device": "cuda:0", "learner_device": "cuda:1", **flags}
        )
        return variant.learner_gpu_budget(args, config, 1) * 2**30

    assert budget() == pytest.approx(0.9 * free - 20 * size)  # weights, gradients, AdamW; the reference
    assert budget(world_size=3) == pytest.approx(0.9 * free - 24 * size)  # DDP: a bucket copy of each gradient
    assert budget(world_size=3, fsdp=True) == pytest.approx(0.9 * free - 20 * size / 3)  # FSDP2: all sharded
    shared = 0.9 * free - 24 * size - 0.3 * (free - 24 * size)  # one GPU: the reward model, then vLLM's 30%
    assert budget(learner_device="cuda:0") == pytest.approx(shared)
    assert budget(learner_device="cuda:0", gpu_memory_utilization=0.5) == pytest.approx(
        0.9 * free - 24 * size - 0.5 * total
    )
    per_sequence = 100 * (2 * 1.27 * (48 * 128 + 16 * 256) + 16 * 512)  # bytes, as in the test above
    args = variant.RunArgs(model_name_or_path=str(tiny / "policy"), engine_device="cuda:0", learner_device="cuda:1")
    assert variant.choose_micro_batch_size(args, 10**9, 100) == int(budget() / per_sequence)
    assert variant.choose_micro_batch_size(args, 16, 100) == 16  # the whole mini-batch when it fits
    assert "of --micro-batch-memory-gib 71.1)" in capsys.readouterr().out  # the budget it resolved, in GiB
    args.micro_batch_memory_gib = 2.5 * per_sequence / 2**30  # a given budget wins over the free memory
    assert variant.choose_micro_batch_size(args, 16, 100) == 2
    free = 20 * size / 0.9  # nothing left beside the models: even one sequence does not fit
    args.micro_batch_memory_gib = None
    with pytest.raises(
        SystemExit,
        match=r"error: one sequence of 100 tokens needs ~0.00 GiB of activations and "
        r"logits, more than the -?0.00 GiB cuda:1 leaves them",
    ):
        variant.choose_micro_batch_size(args, 16, 100)
    args.micro_batch_size = 1  # an explicit size is the user's call
    assert variant.choose_micro_batch_size(args, 16, 100) == 1
    args = variant.RunArgs(model_name_or_path=str(tiny / "policy"), learner_device="cpu", micro_batch_size=None)
    assert variant.choose_micro_batch_size(args, 16, 100) == 16  # on CPU: 4 GiB, as the core


def test_chunks_and_combined_statistics(dpo):
    assert [c.tolist() for c in dpo.chunks(torch.arange(5), 2)] == [[0, 1], [2, 3], [4]]
    stats = dpo.combine_stats([(0.75, dict(loss=2.0, ratio_max=1.5)), (0.25, dict(loss=6.0, ratio_max=3.0))])
    assert stats == dict(loss=3.0, ratio_max=3.0)


# ---------------------------------------------------------------- one optimizer step, any micro-batch size
def reward_model_flags(tiny: Path, architecture: str):
    return (
        "--model-name-or-path",
        str(tiny / f"{architecture}policy"),
        "--reward-model-path",
        str(tiny / f"{architecture}rm"),
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
    )


# GPT-NeoX for the reward-model scripts (the paper's Pythia setups), Llama for GRPO (Rho-1B is Llama-style)
STEP_RUNS = {
    "dpo": ("async_dpo.py", lambda tiny, arithmetic: reward_model_flags(tiny, "neox_")),
    "rloo": ("async_rloo.py", lambda tiny, arithmetic: reward_model_flags(tiny, "neox_")),
    "ppo": ("async_ppo.py", lambda tiny, arithmetic: reward_model_flags(tiny, "neox_")),
    "grpo_gsm8k": (
        "async_grpo_gsm8k.py",
        lambda tiny, arithmetic: (
            "--model-name-or-path",
            str(tiny / "policy"),
            "--dataset-path",
            str(arithmetic),
            "--max-prompt-tokens",
            "256",
            "--response-length",
            "16",
            "--prompts-per-step",
            "32",
            "--num-samples-per-prompt",
            "4",
            "--temperature",
            "1.0",
            "--learning-rate",
            "3e-3",
            "--seed",
            "2",
            "--num-eval-prompts",
            "0",
            "--kv-cache-gib",
            "0.25",
        ),
    ),  # mixed groups
}


@pytest.mark.parametrize("algo", STEP_RUNS)
@pytest.mark.slow
def test_one_optimizer_step_does_not_depend_on_the_micro_batch_size(tiny, arithmetic_folder, tmp_path, algo):
    from transformers import AutoModelForCausalLM

    script, flags = STEP_RUNS[algo]
    params = {}
    for micro_batch_size in (1, 64):  # one sequence (DPO: one pair) at a time, and the whole mini-batch at once
        cwd = tmp_path / f"m{micro_batch_size}"
        cwd.mkdir()
        proc, _ = run_script(
            script,
            cwd,
            *flags(tiny, arithmetic_folder),
            "--num-learner-steps",
            "1",
            "--micro-batch-size",
            str(micro_batch_size),
            "--output-dir",
            str(cwd / "model"),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        model = AutoModelForCausalLM.from_pretrained(cwd / "model", dtype=torch.float32)
        params[micro_batch_size] = torch.cat([p.detach().flatten() for p in model.parameters()])
        metrics = read_metrics(cwd)
    initial = AutoModelForCausalLM.from_pretrained(flags(tiny, arithmetic_folder)[1], dtype=torch.float32)
    initial = torch.cat([p.detach().flatten() for p in initial.parameters()])
    assert (params[1] - initial).abs().max() > 1e-3, "the step did not move the policy: the test would prove nothing"
    print(
        f"{algo}: max |theta(M=1) - theta(M=64)| = {(params[1] - params[64]).abs().max():.2e}, "
        f"max |theta - theta_0| = {(params[1] - initial).abs().max():.2e}"
    )
    assert (params[1] - params[64]).abs().max() < 1e-5
    assert metrics[0]["async/behaviour_learner_logprob_gap"] < 1e-4  # the engine serves the same weights (GPT-NeoX too)


@pytest.mark.parametrize(
    "script", ["sync_baselines/sync_dpo.py", "sync_baselines/sync_rloo.py", "sync_baselines/sync_ppo.py"]
)
@pytest.mark.slow
def test_sync_twins_train_gpt_neox_with_the_engine_in_step(tiny, tmp_path, script):
    proc, _ = run_script(
        script,
        tmp_path,
        *reward_model_flags(tiny, "neox_"),
        "--num-learner-steps",
        "3",
        "--micro-batch-size",
        "2",
        "--gradient-checkpointing",
        "--output-dir",
        str(tmp_path / "model"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(tmp_path)
    assert [m["async/actor_version"] for m in metrics] == [0, 1, 2]
    # the engine samples with the weights the learner has after every update: the sync reaches a GPT-NeoX engine
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-4 for m in metrics)
