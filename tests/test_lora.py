"""async_dpo_lora.py and async_grpo_gsm8k_lora.py: online DPO and GRPO with LoRA adapters that reach a real vLLM engine
version by version. The reference is the base with the adapter disabled; the guard stops a dropped adapter push, an
engine that serves an old adapter and an adapter file that lacks a module, and passes a healthy run; flags vLLM would
ignore are refused before any load. The LoRA helpers are the same in both variants (tests/test_twins.py, LORA_COMMON):
the tests of those run on each variant's module, the runs on each variant's own loop."""

import glob
import json
import os

import pytest
import torch

from conftest import load_script, read_metrics, run_script, run_until_sigterm

LORA = "async_dpo_lora.py"
GRPO_LORA = "async_grpo_gsm8k_lora.py"


def common_flags(tiny, *extra):
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
        "--lora-rank",
        "4",
        "--seed",
        "3",
        *extra,
    )


@pytest.fixture(scope="module", params=[LORA, GRPO_LORA])
def lora(request):
    return load_script(request.param)


def learner_and_engine(lora, tiny, tmp_path):
    args = lora.RunArgs(
        model_name_or_path=str(tiny / "policy"),
        engine_device="cpu",
        learner_device="cpu",
        kv_cache_gib=0.25,
        max_prompt_tokens=96,
        response_length=16,
        lora_rank=4,
    )
    args.adapter_dir = str(tmp_path / "adapters")
    policy = lora.load_lora_policy(args)
    return args, policy, lora.build_engine(args)


def test_the_reference_is_the_base_with_the_adapter_disabled(lora, tiny, tmp_path):
    """After a few updates the adapter moves the policy; disabled, it gives a separate frozen copy's logprobs to float32
    rounding, and the optimizer's parameters are the adapter's alone."""
    from transformers import AutoModelForCausalLM

    args = lora.RunArgs(model_name_or_path=str(tiny / "policy"), learner_device="cpu", lora_rank=4)
    policy = lora.load_lora_policy(args)
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_A" in n or "lora_B" in n for n in trained)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(5, 500, (4, 20), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        optimizer.zero_grad()
        policy(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    frozen = AutoModelForCausalLM.from_pretrained(tiny / "policy", dtype=torch.float32).eval()
    ids, ones = batch, torch.ones_like(batch)
    with torch.no_grad():
        with policy.disable_adapter():
            reference = lora.token_logprobs(policy, ids, ones, ones, 1.0)
        adapted = lora.token_logprobs(policy, ids, ones, ones, 1.0)
        separate = lora.token_logprobs(frozen, ids, ones, ones, 1.0)
    assert (adapted - separate).abs().max() > 1e-3  # the adapter is not the base any more
    assert torch.allclose(reference, separate, atol=1e-5, rtol=0)


def test_the_guard_passes_healthy_adapters_and_stops_dropped_stale_and_partial_pushes(lora, tiny, tmp_path):
    """Twelve healthy versions pass (the engine answers the probe through each adapter as the learner does). A push
    that never reaches the engine, an engine that serves an old adapter under the new version's id, and an adapter
    file without one module's tensors each stop with one line."""
    args, policy, llm = learner_and_engine(lora, tiny, tmp_path)
    probe = list(range(5, 37))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(5, 500, (8, 24), generator=torch.Generator().manual_seed(0))

    def learner_step(version):  # next-token loss on a fixed batch that is not the probe, then the adapter saved
        optimizer.zero_grad()
        policy(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        return lora.save_adapter(policy, version, probe, args)

    adapter = lora.adapter_request(args, 0)
    check = lora.save_adapter(policy, 0, probe, args)
    lora.push_weights_to_engine(llm, adapter, None)
    last = lora.check_weight_sync(llm, check, None, args, 0, adapter)
    for version in range(1, 13):
        check = learner_step(version)
        new = lora.adapter_request(args, version)
        if version == 4:  # dropped: the thread names the new version, but the engine never got it
            with pytest.raises(RuntimeError, match="does not serve policy version 4 .*holds adapters \\[4\\], not 5"):
                lora.check_weight_sync(llm, check, last, args, version, new)
        if version == 7:  # stale: the new adapter under the old one's id, which vLLM has cached
            stale = type(new)(new.lora_name, adapter.lora_int_id, new.lora_path)
            with pytest.raises(RuntimeError, match="does not serve policy version 7 .*earlier version"):
                lora.check_weight_sync(llm, check, last, args, version, stale)
        if version == 10:  # partial: one module's A and B missing from the file the engine reads
            path = os.path.join(new.lora_path, "adapter_model.safetensors")
            from safetensors.torch import load_file, save_file

            tensors = load_file(path)
            save_file({n: t for n, t in tensors.items() if "layers.1.mlp.down_proj" not in n}, path)
            with pytest.raises(RuntimeError, match="does not serve policy version 10 .*2 adapter tensors missing"):
                lora.check_weight_sync(llm, check, last, args, version, new)
            policy.save_pretrained(new.lora_path)  # the push done right
        lora.push_weights_to_engine(llm, new, adapter)
        last = lora.check_weight_sync(llm, check, last, args, version, new)  # healthy: passes
        assert not os.path.exists(adapter.lora_path)  # the old adapter is dropped: no batch needs it again
        adapter = new
    assert llm.llm_engine.list_loras() == {13}


def test_a_run_trains_the_adapter_the_engine_serves_and_saves_adapter_and_merged_model(tiny, tmp_path):
    """--async-steps 0: every batch is sampled by the learner's current adapter (logprob gap at float32 rounding); K =
    1: version max(0, i-1). The final policy is an adapter folder, --save-merged adds a plain model folder that loads,
    and no adapter is left in the hand-off folder."""
    from transformers import AutoModelForCausalLM

    for k in ("0", "1"):
        cwd = tmp_path / f"k{k}"
        cwd.mkdir()
        flags = ("--num-learner-steps", "5", "--async-steps", k, "--save-merged", "--output-dir", str(cwd / "model"))
        proc, _ = run_script(LORA, cwd, *common_flags(tiny, *flags))
        assert proc.returncode == 0, proc.stderr[-4000:]
        metrics = read_metrics(cwd)
        assert [m["async/actor_version"] for m in metrics] == ([0, 1, 2, 3, 4] if k == "0" else [0, 0, 1, 2, 3])
        if k == "0":
            assert all(m["async/behaviour_learner_logprob_gap"] < 1e-5 for m in metrics)
        assert metrics[-1]["objective/kl"] != 0.0
        config = json.loads((cwd / "model" / "adapter_config.json").read_text())
        assert config["r"] == 4 and set(config["target_modules"]) == {
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        }
        merged = AutoModelForCausalLM.from_pretrained(cwd / "model" / "merged")
        base = AutoModelForCausalLM.from_pretrained(tiny / "policy")
        assert not torch.equal(merged.model.layers[0].mlp.down_proj.weight, base.model.layers[0].mlp.down_proj.weight)
        assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)  # not a target
        assert "the merged policy is in" in proc.stdout
        assert adapters_left(cwd) == []


def adapters_left(cwd):
    """The hand-off folders in /dev/shm (RAM) that the run in `cwd` left: they are named after its run."""
    (run,) = (cwd / "runs").iterdir()
    return glob.glob(f"/dev/shm/adapters_{run.name}_*")


def test_a_stopped_run_leaves_no_adapters_in_shared_memory(tiny, tmp_path):
    """A SIGTERM stop ends the run through sys.exit, as a guard stop does: the adapters in /dev/shm go with it."""
    flags = common_flags(tiny, "--num-learner-steps", "40", "--output-dir", str(tmp_path / "model"))
    returncode, _, stderr = run_until_sigterm(LORA, tmp_path, flags, after_steps=2)
    assert returncode != 0 and "SIGTERM: stopped after learner step" in stderr, stderr[-3000:]
    assert os.path.isdir("/dev/shm") and adapters_left(tmp_path) == []


def grpo_flags(tiny, arithmetic_folder, *extra):
    # temperature 1 and 16 problems x 4 samples: groups of mixed rewards, so that the tiny policy's adapter moves
    return (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--dataset-path",
        str(arithmetic_folder),
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
        "--kv-cache-gib",
        "0.25",
        *extra,
    )


def test_a_grpo_run_hands_over_eleven_adapters_and_saves_a_model_the_core_trains_on(tiny, arithmetic_folder, tmp_path):
    """--async-steps 0, 11 learner steps of 2 mini-batches, with a KL term: versions 0-10 reach the engine as adapters
    through the thread and version 11 for the final evaluation, each passing the guard; every batch is sampled by the
    learner's current adapter (logprob gap at float32 rounding) while the KL to the base, the adapter disabled, grows
    from 0. The adapter folder and --save-merged's model folder are the same policy, and the GRPO core trains on the
    merged folder as its --model-name-or-path (its own guard and gap check that its engine serves it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    flags = (
        "--num-learner-steps",
        "11",
        "--async-steps",
        "0",
        "--num-mini-batches",
        "2",
        "--kl-coef",
        "0.05",
        "--lora-rank",
        "4",
    )
    flags += ("--num-eval-prompts", "8", "--eval-every", "5", "--save-merged", "--output-dir", str(tmp_path / "model"))
    proc, _ = run_script(GRPO_LORA, tmp_path, *grpo_flags(tiny, arithmetic_folder, *flags))
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(tmp_path)
    assert [m["async/actor_version"] for m in metrics] == list(range(11))
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-5 for m in metrics)
    assert metrics[-1]["objective/kl"] > 1e-3 and max(abs(m["losses/policy_loss"]) for m in metrics) > 0
    evals = [json.loads(line) for line in next((tmp_path / "runs").glob("*/eval.jsonl")).read_text().splitlines()]
    assert [e["policy_version"] for e in evals] == [0, 5, 10, 11]
    config = json.loads((tmp_path / "model" / "adapter_config.json").read_text())
    assert config["r"] == 4 and "down_proj" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(tiny / "policy", dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model" / "merged", dtype=torch.float32).eval()
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {"merged": merged(input_ids=ids).logits}
        logits["base"] = base(input_ids=ids).logits
        logits["adapter"] = PeftModel.from_pretrained(base, tmp_path / "model").eval()(input_ids=ids).logits
    assert (logits["adapter"] - logits["base"]).abs().max() > 1e-3  # the adapter is not the base
    assert torch.allclose(logits["merged"], logits["adapter"], atol=1e-5, rtol=0)
    core = tmp_path / "core"
    core.mkdir()
    flags = (
        "--model-name-or-path",
        str(tmp_path / "model" / "merged"),
        "--num-learner-steps",
        "1",
        "--async-steps",
        "0",
        "--prompts-per-step",
        "4",
        "--num-eval-prompts",
        "0",
        "--output-dir",
        str(core / "model"),
    )
    proc, _ = run_script("async_grpo_gsm8k.py", core, *grpo_flags(tiny, arithmetic_folder, *flags))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert read_metrics(core)[0]["async/behaviour_learner_logprob_gap"] < 1e-5


# the flags vLLM would not serve (target modules, ranks, an unknown base) are in test_bad_inputs.py's table
