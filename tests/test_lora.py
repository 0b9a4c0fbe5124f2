"""async_dpo_lora.py and async_grpo_gsm8k_lora.py: online DPO and GRPO with LoRA adapters that reach a real vLLM engine
version by version. The reference is the base with the adapter disabled; the guard reads the adapter the engine holds
and stops each fault at the version it happens, at the default learning rate, and passes a healthy run; flags vLLM
would ignore, and --engine-dtype auto, are refused before any load. The LoRA helpers are the same in both variants
(tests/test_twins.py, LORA_COMMON): the tests of those run on each variant's module, the runs on each variant's own
loop."""

import glob
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

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
    )
    args.adapter_dir = str(tmp_path / "adapters")
    torch.manual_seed(0)  # PEFT draws A at random
    policy = lora.load_lora_policy(args)
    return args, policy, lora.build_engine(args)


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_guard_reads_the_adapter_the_engine_holds_and_stops_each_fault_at_its_version(lora, tiny, tmp_path):
    """Twenty versions at the default learning rate, decayed over 20 steps, trained by DPO on random pairs: the probe
    (a prompt, as the scripts') moves as in a run, less than 1e-4 a version late in it, so only what the engine holds
    can tell. Healthy versions pass; each fault put into the engine stops at the very version it happens: a push that
    never reaches it (v4); one module's A and B left at the previous version's (v6); a file without one module's A and
    B (v8); an engine stuck on v11's adapter, loading it under each new id (v12, v13); v15's under v16's id (v16)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    args, policy, llm = learner_and_engine(lora, tiny, tmp_path)
    text = json.loads((tiny / "prompts.jsonl").read_text().splitlines()[0])["query"]
    probe = AutoTokenizer.from_pretrained(tiny / "policy")(text)["input_ids"][:32]
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.learning_rate, eps=1e-5, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 - update / 20)
    down = llm.collective_rpc(lambda w: w.get_model())[0].get_submodule("model.layers.1.mlp.down_proj")

    def slot():  # the A and B that the engine's adapter slot holds for one module
        return [down.lora_a_stacked[0][0], down.lora_b_stacked[0][0]]

    def serve(folder):  # the engine loads `folder` under the new version's id
        wrong = type(new)(new.lora_name, new.lora_int_id, str(shutil.copytree(folder, tmp_path / f"copy{version}")))
        lora.push_weights_to_engine(llm, wrong, served)
        return wrong

    served = lora.adapter_request(args, 0)  # what the engine holds; its folder goes with it
    check = lora.save_adapter(policy, 0, probe, args)
    lora.push_weights_to_engine(llm, served, None)
    last = lora.check_weight_sync(llm, check, None, args, 0, served)
    for version in range(1, 21):
        pairs = torch.randint(5, 500, (8, 24), generator=torch.Generator().manual_seed(version))
        ones = torch.ones_like(pairs)
        with torch.no_grad(), policy.disable_adapter():
            reference = lora.token_logprobs(policy, pairs, ones, ones, 1.0).sum(1)
        logratio = lora.token_logprobs(policy, pairs, ones, ones, 1.0).sum(1) - reference
        optimizer.zero_grad()
        (-torch.nn.functional.logsigmoid(0.1 * (logratio[:4] - logratio[4:]))).mean().backward()
        optimizer.step()
        scheduler.step()
        check = lora.save_adapter(policy, version, probe, args)
        new = lora.adapter_request(args, version)
        stop = f"does not serve policy version {version} .*"
        if version == 4:  # dropped: the thread names the new version, but the engine never got it
            with pytest.raises(RuntimeError, match=stop + "holds adapters \\[4\\], not 5"):
                lora.check_weight_sync(llm, check, last, args, version, new)
        if version == 6:  # loaded and in its slot, but for one module's A and B, which are v5's
            stale = [t.clone() for t in slot()]
            lora.push_weights_to_engine(llm, new, served)
            llm.generate([{"prompt_token_ids": probe}], SamplingParams(max_tokens=1), lora_request=new, use_tqdm=False)
            fresh = [t.clone() for t in slot()]
            assert not any(map(torch.equal, stale, fresh))
            for held, old in zip(slot(), stale):
                held.copy_(old)
            with pytest.raises(RuntimeError, match=stop + "2 of 28 tensors differ .*layers.1.mlp.down_proj.lora_A"):
                lora.check_weight_sync(llm, check, last, args, version, new)
            for held, now in zip(slot(), fresh):  # mended
                held.copy_(now)
            served = new
        if version == 8:  # partial: the file the engine reads lacks one module's A and B
            path = os.path.join(new.lora_path, "adapter_model.safetensors")
            tensors = load_file(path)
            save_file({n: t for n, t in tensors.items() if "layers.1.mlp.down_proj" not in n}, path)
            served = serve(new.lora_path)
            with pytest.raises(RuntimeError, match=stop + "2 of 28 tensors differ .*layers.1.mlp.down_proj.lora_A"):
                lora.check_weight_sync(llm, check, last, args, version, new)
            save_file(tensors, path)  # then the push done right
        if version in (11, 15):  # kept for the faults that serve them later
            shutil.copytree(new.lora_path, tmp_path / f"v{version}")
        if version in (12, 13):  # stuck on v11's adapter; the guard's last pass was v11's
            served = serve(tmp_path / "v11")
            with pytest.raises(RuntimeError, match=stop + "28 of 28 tensors differ"):
                lora.check_weight_sync(llm, check, last, args, version, new)
            if version == 12:
                continue
        if version == 16:  # v15's adapter under v16's id, late in the run: the rate has decayed
            served = serve(tmp_path / "v15")
            with pytest.raises(RuntimeError, match=stop + "28 of 28 tensors differ"):
                lora.check_weight_sync(llm, check, last, args, version, new)
        if served is not new:  # healthy
            lora.push_weights_to_engine(llm, new, served)
            assert not os.path.exists(served.lora_path)  # the old adapter is dropped: no batch needs it again
        last = lora.check_weight_sync(llm, check, last, args, version, new)
        served = new
    assert llm.llm_engine.list_loras() == {21}


def test_a_run_trains_the_adapter_the_engine_serves_and_saves_adapter_and_merged_model(tiny, tmp_path):
    """--async-steps 0: every batch is sampled by the learner's current adapter (logprob gap at float32 rounding); K =
    1: version max(0, i-1). The final policy is an adapter folder, --save-merged adds a plain model folder that loads,
    and no adapter is left in the hand-off folder."""
    from transformers import AutoModelForCausalLM

    def run(k):
        cwd = tmp_path / f"k{k}"
        cwd.mkdir()
        flags = ("--num-learner-steps", "5", "--async-steps", k, "--save-merged", "--output-dir", str(cwd / "model"))
        return cwd, run_script(LORA, cwd, *common_flags(tiny, *flags))[0]

    with ThreadPoolExecutor(2) as pool:  # side by side
        runs = dict(zip("01", pool.map(run, "01")))
    for k, (cwd, proc) in runs.items():
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


def test_the_hand_off_goes_to_disk_where_dev_shm_cannot_hold_the_adapters(lora, tmp_path, capsys):
    """/dev/shm (RAM) takes the hand-off folder where the K+2 adapters that may exist at once fit; where they do not
    (Docker's default 64 MiB holds no two rank-16 adapters of an 8B model), a temporary folder on disk, said once."""
    args = lora.RunArgs(async_steps=1)
    args.run_name = tmp_path.name
    small, huge = [torch.zeros(2**18)], [torch.empty(2**50, device="meta")]  # 1 MiB and 4 PiB of adapter tensors
    folders = [lora.make_adapter_dir(args, trained) for trained in (small, huge)]
    assert folders[0].startswith("/dev/shm/") and os.path.isdir(folders[1]) and not folders[1].startswith("/dev/shm")
    assert capsys.readouterr().out == f"note: /dev/shm cannot hold 3 adapters ({3 * 2**32} MiB): using {folders[1]}\n"
    for folder in folders:
        shutil.rmtree(folder)


def test_engine_dtype_auto_is_refused_as_in_the_cores(lora, tiny):
    """The guard compares the adapter in the dtype the engine holds it and sets its tolerance by it: "auto" names
    none, so it stops before any model loads, as in async_dpo.py and async_grpo_gsm8k.py."""
    flags = dict(model_name_or_path=str(tiny / "policy"), max_prompt_tokens=64, response_length=16)
    if hasattr(lora.Args, "reward_model_path"):  # DPO's
        flags["reward_model_path"] = str(tiny / "rm")
    lora.check_args(lora.RunArgs(**flags))  # good flags
    with pytest.raises(SystemExit, match="--engine-dtype must be float32, bfloat16 or float16, got 'auto'"):
        lora.check_args(lora.RunArgs(**flags, engine_dtype="auto"))


@pytest.mark.slow
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


@pytest.fixture(scope="module")
def grpo_lora_run(tiny, arithmetic_folder, tmp_path_factory):
    """--async-steps 0, 11 learner steps of 2 mini-batches with a KL term, snapshots every 5, merged model saved."""
    folder = tmp_path_factory.mktemp("grpo_lora")
    flags = ("--num-learner-steps", "11", "--async-steps", "0", "--num-mini-batches", "2", "--kl-coef", "0.05")
    flags += ("--lora-rank", "4", "--num-eval-prompts", "8", "--eval-every", "5", "--save-every", "5")
    flags += ("--save-merged", "--output-dir", str(folder / "model"))
    proc, _ = run_script(GRPO_LORA, folder, *grpo_flags(tiny, arithmetic_folder, *flags))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


def test_a_grpo_run_hands_over_eleven_adapters_and_saves_the_adapter_as_a_merged_model(tiny, grpo_lora_run):
    """Versions 0-10 reach the engine as adapters through the thread and version 11 for the final evaluation, each
    passing the guard; every batch is sampled by the learner's current adapter (logprob gap at float32 rounding) while
    the KL to the base, the adapter disabled, grows from 0. The adapter folder and --save-merged's model folder are the
    same policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    metrics = read_metrics(grpo_lora_run)
    assert [m["async/actor_version"] for m in metrics] == list(range(11))
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-5 for m in metrics)
    assert metrics[-1]["objective/kl"] > 1e-3 and max(abs(m["losses/policy_loss"]) for m in metrics) > 0
    evals = [json.loads(line) for line in next((grpo_lora_run / "runs").glob("*/eval.jsonl")).read_text().splitlines()]
    assert [e["policy_version"] for e in evals] == [0, 5, 10, 11]
    config = json.loads((grpo_lora_run / "model" / "adapter_config.json").read_text())
    assert config["r"] == 4 and "down_proj" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(tiny / "policy", dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(grpo_lora_run / "model" / "merged", dtype=torch.float32).eval()
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {"merged": merged(input_ids=ids).logits}
        logits["base"] = base(input_ids=ids).logits
        logits["adapter"] = PeftModel.from_pretrained(base, grpo_lora_run / "model").eval()(input_ids=ids).logits
    assert (logits["adapter"] - logits["base"]).abs().max() > 1e-3  # the adapter is not the base
    assert torch.allclose(logits["merged"], logits["adapter"], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tools_evaluate_grades_the_adapters_and_the_grpo_core_trains_on_the_merged_model(
    tiny, arithmetic_folder, grpo_lora_run
):
    """tools/evaluate.py grades the run's last adapter snapshot and the final adapter, each as its merged model; the
    GRPO core trains on the merged folder as its --model-name-or-path (its own guard and gap check that its engine
    serves it). The two go side by side."""
    (run,) = (grpo_lora_run / "runs").iterdir()
    folders = [run, grpo_lora_run / "model", grpo_lora_run / "model" / "merged"]
    flags = ("--dataset-path", str(arithmetic_folder), "--num-eval-prompts", "8", "--kv-cache-gib", "0.25")
    flags += ("--max-prompt-tokens", "256", "--response-length", "16")  # as the run's
    core, graded_in = grpo_lora_run / "core", grpo_lora_run / "evaluate"  # the run's folder stays as it ended
    core.mkdir()
    graded_in.mkdir()
    evaluate = ("tools/evaluate.py", graded_in, *map(str, folders), *flags)
    flags = ("--model-name-or-path", str(folders[2]), "--num-learner-steps", "1", "--async-steps", "0")
    flags += ("--prompts-per-step", "4", "--num-eval-prompts", "0", "--output-dir", str(core / "model"))
    train = ("async_grpo_gsm8k.py", core, *grpo_flags(tiny, arithmetic_folder, *flags))
    with ThreadPoolExecutor(2) as pool:
        (proc, _), (trained, _) = pool.map(lambda command: run_script(*command), (evaluate, train))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["policy"] for r in results] == [str(run / "checkpoint_10" / "policy"), *map(str, folders[1:])]
    graded = [{k: v for k, v in r.items() if k.startswith("eval/")} for r in results]
    assert len(graded[0]) == 2 and graded[1] == graded[2]  # the adapter graded as its merged model
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert read_metrics(core)[0]["async/behaviour_learner_logprob_gap"] < 1e-5


# the flags vLLM would not serve (target modules, ranks, an unknown base) are in test_bad_inputs.py's table
