"""The multigpu variants' exact resume: a run stopped by a real SIGTERM saves a checkpoint and, resumed, logs exactly
what an uninterrupted run logs. Async PPO with K = 2 (a value model, the learner's own shuffling generator, and two
batches in flight that were made by versions no checkpoint holds) and GRPO with --async-steps 0 (sync at scale;
held-out evaluations) on the tiny models, real engine. The cores' SIGTERM save is tested in test_layout.py."""

import json
import re

import pytest

from conftest import load_script, read_metrics, run_script, run_until_sigterm

STEPS = 6
PPO, GRPO = "multigpu/async_ppo_multigpu.py", "multigpu/async_grpo_gsm8k_multigpu.py"
LOSSES = {
    PPO: (
        "losses/policy_loss",
        "losses/value_loss",
        "objective/scores",
        "objective/kl",
        "policy/approx_kl",
        "async/actor_version",
    ),
    GRPO: ("losses/policy_loss", "objective/accuracy", "policy/approx_kl", "policy/grad_norm"),
}


def flags(script, tiny, arithmetic_folder):
    common = (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--response-length",
        "16",
        "--prompts-per-step",
        "4",
        "--num-learner-steps",
        str(STEPS),
        "--learning-rate",
        "3e-3",
        "--seed",
        "5",
        "--kv-cache-gib",
        "0.25",
        "--save-every",
        "2",
    )
    if script == PPO:
        return (
            *common,
            "--reward-model-path",
            str(tiny / "rm"),
            "--dataset-name",
            str(tiny / "prompts.jsonl"),
            "--max-prompt-tokens",
            "64",
            "--num-samples-per-prompt",
            "2",
            "--async-steps",
            "2",
            "--num-mini-batches",
            "2",
        )
    return (
        *common,
        "--dataset-path",
        str(arithmetic_folder),
        "--max-prompt-tokens",
        "128",
        "--num-eval-prompts",
        "8",
        "--eval-every",
        "2",
        "--temperature",
        "1.0",
        "--async-steps",
        "0",
    )


def assert_a_model_folder(script, folder, tiny, arithmetic_folder):
    """A checkpoint's policy is a model folder (issue 55: it had no tokenizer, and as --model-name-or-path the input
    checks failed with a traceback asking for sentencepiece): the variant's own checks take it, and it holds the
    run's tokenizer and EOS ids (the tiny tokenizer's EOS is id 0)."""
    from transformers import AutoTokenizer

    variant = load_script(script)
    data = (
        dict(reward_model_path=str(tiny / "rm"), dataset_name=str(tiny / "prompts.jsonl"), max_prompt_tokens=64)
        if script == PPO
        else dict(dataset_path=str(arithmetic_folder), max_prompt_tokens=128)
    )
    args = variant.RunArgs(model_name_or_path=str(folder), response_length=16, **data)
    variant.check_args(args)
    tokenizer, eos_token_ids = variant.load_tokenizer(args)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny / "policy").get_vocab()
    assert eos_token_ids == (0,) and (folder / "generation_config.json").exists()


@pytest.mark.parametrize("script", list(LOSSES))
@pytest.mark.slow
def test_a_run_stopped_by_sigterm_and_resumed_logs_what_an_uninterrupted_run_logs(
    tiny, arithmetic_folder, tmp_path, script
):
    args = flags(script, tiny, arithmetic_folder)
    (tmp_path / "whole").mkdir()
    (tmp_path / "stopped").mkdir()
    proc, _ = run_script(script, tmp_path / "whole", *args, "--keep-checkpoints", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = read_metrics(tmp_path / "whole")
    # --keep-checkpoints 0 keeps every checkpoint (the last step saves none: the model goes to --output-dir)
    assert sorted(p.name for p in (tmp_path / "whole" / "runs").glob("*/checkpoint_*")) == [
        "checkpoint_2",
        "checkpoint_4",
    ]
    # a clean end: the summary's line is the last one printed (issue 55: a traceback of vLLM's teardown followed it)
    assert proc.stdout.splitlines()[-1].startswith("plot:") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert_a_model_folder(
        script, next((tmp_path / "whole" / "runs").glob("*/checkpoint_2/policy")), tiny, arithmetic_folder
    )

    returncode, _, stderr = run_until_sigterm(script, tmp_path / "stopped", args, after_steps=3)
    assert returncode != 0
    assert "SIGTERM: stopped after learner step" in stderr, stderr[-3000:]
    (run_dir,) = (tmp_path / "stopped" / "runs").iterdir()
    (checkpoint,) = run_dir.glob("checkpoint_*")  # older checkpoints are deleted once a newer one is complete
    assert_a_model_folder(script, checkpoint / "policy", tiny, arithmetic_folder)  # a stop's save too
    saved = int(checkpoint.name.split("_")[1])
    assert 3 <= saved < STEPS
    # a save that was killed half-way leaves a .tmp folder: never taken for a checkpoint
    (run_dir / "checkpoint_99.tmp").mkdir()
    assert len(read_metrics(tmp_path / "stopped")) >= saved

    proc, _ = run_script(script, tmp_path / "stopped", *args, "--resume-from", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = read_metrics(tmp_path / "stopped")
    assert [m["step"] for m in resumed] == list(range(STEPS))  # the steps logged after the checkpoint ran again
    for key in LOSSES[script]:
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in whole], abs=1e-6), key
    assert any(m["losses/policy_loss"] != whole[0]["losses/policy_loss"] for m in whole), "nothing trained"
    if script != PPO:
        evaluations = [
            [json.loads(line) for line in (cwd / "runs").glob("*/eval.jsonl").__next__().read_text().splitlines()]
            for cwd in (tmp_path / "whole", tmp_path / "stopped")
        ]
        assert [e["policy_version"] for e in evaluations[1]] == [0, 2, 4, 6]
        assert [e["eval/accuracy"] for e in evaluations[1]] == [e["eval/accuracy"] for e in evaluations[0]]
    assert (tmp_path / "stopped" / run_dir.relative_to(tmp_path / "stopped") / "model" / "config.json").exists()
    # the resumed run names its checkpoint; time/elapsed goes on from the stopped run's, so the idle shares of the
    # summary are of the whole run's time (they read 435% when it restarted at 0)
    assert f"resuming from {checkpoint}" in proc.stdout
    elapsed = [m["time/elapsed"] for m in resumed]
    assert elapsed == sorted(elapsed) and elapsed[saved] > elapsed[saved - 1]
    idle = re.search(r"idle: learner (\d+)%, generation (\d+)%", proc.stdout)
    assert idle and max(map(int, idle.groups())) <= 100, proc.stdout[-2000:]

    if script == GRPO:  # resumed from its earlier checkpoint, the finished run replaces its later one (it crashed)
        (whole_dir,) = (tmp_path / "whole" / "runs").iterdir()
        proc, _ = run_script(
            script,
            tmp_path / "whole",
            *args,
            "--keep-checkpoints",
            "0",
            "--resume-from",
            str(whole_dir / "checkpoint_2"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "the run's later checkpoint_4 (whose logs were just cut) are deleted" in proc.stdout
        assert sorted(p.name for p in whole_dir.glob("checkpoint_*")) == ["checkpoint_2", "checkpoint_4"]
        assert (whole_dir / "checkpoint_4" / "state.pt").exists() and (whole_dir / "model" / "config.json").exists()
        again = read_metrics(tmp_path / "whole")
        assert [m["step"] for m in again] == list(range(STEPS))
        for key in LOSSES[script]:
            assert [m[key] for m in again] == pytest.approx([m[key] for m in whole], abs=1e-6), key


def test_resuming_with_other_training_flags_is_refused(tiny, tmp_path):
    """A checkpoint is continued with the flags it was made with; only where it runs and how it reports may change."""
    from conftest import load_script

    grpo = load_script(GRPO)
    run_dir = tmp_path / "runs" / "async_grpo_gsm8k_multigpu__1__1"
    (run_dir / "checkpoint_2").mkdir(parents=True)
    import torch

    torch.save(
        dict(step=2, args=dict(vars(grpo.RunArgs(run_name="async_grpo_gsm8k_multigpu__1__1")))),
        run_dir / "checkpoint_2" / "state.pt",
    )
    changed = grpo.RunArgs(resume_from=str(run_dir), learning_rate=1e-4)
    with pytest.raises(
        SystemExit,
        match=r"error: --resume-from: --learning-rate is 0.0001 here but was 3e-06 in "
        r"the run; resume with the run's own flags",
    ):
        grpo.load_checkpoint(changed)
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        grpo.load_checkpoint(grpo.RunArgs(resume_from=str(tmp_path)))


def test_resuming_keeps_the_micro_batch_the_default_chose(tmp_path, monkeypatch):
    """A run started without --micro-batch-size saved the size its default chose; resumed without the flag it keeps
    that size (a new choice could differ), and an explicit other size is refused like any other training flag."""
    import torch

    from conftest import load_script

    grpo = load_script(GRPO)
    run_dir = tmp_path / "runs" / "async_grpo_gsm8k_multigpu__1__1"
    (run_dir / "checkpoint_2").mkdir(parents=True)
    saved = vars(grpo.RunArgs(run_name=run_dir.name, micro_batch_size=16))
    torch.save(dict(step=2, args=dict(saved)), run_dir / "checkpoint_2" / "state.pt")
    monkeypatch.chdir(tmp_path)  # a run is resumed in the folder that holds its runs/
    default = grpo.RunArgs(resume_from=str(run_dir))
    assert grpo.load_checkpoint(default)["step"] == 2 and default.micro_batch_size == 16
    with pytest.raises(SystemExit, match="--micro-batch-size is 8 here but was 16 in the run"):
        grpo.load_checkpoint(grpo.RunArgs(resume_from=str(run_dir), micro_batch_size=8))


def test_another_scripts_a_damaged_or_a_core_s_checkpoint_is_refused_in_one_line(tmp_path):
    """A DPO checkpoint given to RLOO names the script that made it; a cut-short state.pt is named; a core's run folder
    is told apart (the cores save policy snapshots, which do not resume)."""
    import torch

    from conftest import load_script

    dpo, rloo = load_script("multigpu/async_dpo_multigpu.py"), load_script("multigpu/async_rloo_multigpu.py")
    run_dir = tmp_path / "runs" / "async_dpo_multigpu__1__1"
    (run_dir / "checkpoint_2").mkdir(parents=True)
    state = run_dir / "checkpoint_2" / "state.pt"
    torch.save(dict(step=2, args=dict(vars(dpo.RunArgs(run_name=run_dir.name)))), state)
    with pytest.raises(
        SystemExit,
        match=r"error: --resume-from .* is a checkpoint of async_dpo_multigpu, not of "
        r"async_rloo_multigpu: resume it with the script",
    ):
        rloo.load_checkpoint(rloo.RunArgs(resume_from=str(run_dir)))
    state.write_bytes(state.read_bytes()[:200])
    with pytest.raises(SystemExit, match=f"error: --resume-from: {re.escape(str(state))} cannot be read"):
        dpo.load_checkpoint(dpo.RunArgs(resume_from=str(run_dir)))
    # a core's run folder, or one of its policy snapshots (save_policy: checkpoint_<step>/policy, nothing else)
    core_run = tmp_path / "runs" / "async_rloo__1__1"
    (core_run / "checkpoint_4" / "policy").mkdir(parents=True)
    for given in (core_run, core_run / "checkpoint_4"):
        with pytest.raises(SystemExit, match=r"holds no checkpoint \(--save-every's; a core script saves none\)$"):
            rloo.load_checkpoint(rloo.RunArgs(resume_from=str(given)))
