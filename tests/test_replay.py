"""Record and replay (docs/multigpu.md#record-and-replay): the batches a run trained on (--record-samples), trained on
again without an engine (--replay-from). With the run's own flags the replay trains the very same weights, bit for bit;
under another --off-policy-correction, other weights from the same samples; under torchrun, the same weights to float
rounding; and a replay that cannot be the recorded run is refused in one line before any model loads. Real engine for
the recordings, tiny models."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, load_script, read_metrics, run_script
from test_distributed import torchrun

RLOO, DPO = "multigpu/async_rloo_multigpu.py", "multigpu/async_dpo_multigpu.py"
STEPS = 4
# vLLM refuses to start with a million-GiB KV cache (measured: "Available memory ... is less than requested memory for
# kv"), so a replay given this flag that ends well has built no engine
NO_ENGINE = ("--kv-cache-gib", "1000000")


def flags(tiny, *extra):
    return ("--model-name-or-path", str(tiny / "policy"), "--reward-model-path", str(tiny / "rm"), "--dataset-name",
            str(tiny / "prompts.jsonl"), "--max-prompt-tokens", "64", "--response-length", "16", "--prompts-per-step",
            "4", "--num-samples-per-prompt", "2", "--num-learner-steps", str(STEPS), "--learning-rate", "3e-3",
            "--seed", "5", "--async-steps", "2", "--micro-batch-size", "4", *extra)


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    """{script: its run folder}: K = 2 runs on the real engine with --record-samples (DPO for two steps)."""
    runs = {}
    for script, steps in ((RLOO, STEPS), (DPO, 2)):
        cwd = tmp_path_factory.mktemp("record")
        proc, _ = run_script(script, cwd, *flags(tiny, "--kv-cache-gib", "0.25", "--record-samples",
                                                 "--num-learner-steps", str(steps)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (runs[script],) = (cwd / "runs").iterdir()
    return runs


def replay(script, run, tiny, cwd, *extra, launch=run_script):
    """Replay `run` (no engine: see NO_ENGINE); returns (final weights, metrics)."""
    steps = str(STEPS if script == RLOO else 2)
    proc, _ = launch(script, cwd, *flags(tiny, *NO_ENGINE, "--replay-from", str(run), "--num-learner-steps", steps,
                                         *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (folder,) = (cwd / "runs").iterdir()
    return load_file(folder / "model" / "model.safetensors"), read_metrics(cwd)


def weights_and_metrics(run):
    return load_file(run / "model" / "model.safetensors"), [json.loads(line) for line in
                                                            (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("script", [RLOO, DPO])
def test_a_replay_with_the_runs_own_flags_trains_the_same_weights_bit_for_bit(recorded, tiny, tmp_path, script):
    run = recorded[script]
    steps = STEPS if script == RLOO else 2
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["meta.json"] + [f"step_{i:06d}.pt"
                                                                                    for i in range(steps)]
    # another reward model: the replay scores nothing, it trains on the recorded rewards
    weights, metrics = replay(script, run, tiny, tmp_path, "--reward-model-path", str(tiny / "neox_rm"))
    expected_weights, expected = weights_and_metrics(run)
    initial = load_file(tiny / "policy" / "model.safetensors")
    assert any(not torch.equal(expected_weights[name], initial[name]) for name in initial)  # the run did train
    # the same float32 operations in the same order on the same inputs: the learner thread shares its process with the
    # engine in the recorded run only, and no learner computation depends on it
    assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
    for replayed, original in zip(metrics, expected, strict=True):  # async/ too: the recorded versions
        assert {k: v for k, v in replayed.items() if not k.startswith("time/")} == {
            k: v for k, v in original.items() if not k.startswith("time/")}
        assert replayed["time/generation"] == replayed["time/weight_sync"] == 0.0
    if script == RLOO:
        assert [m["async/actor_version"] for m in metrics] == [0, 0, 0, 1]  # max(0, i - K), K = 2


def test_a_replay_under_another_correction_trains_on_the_same_samples_to_other_weights(recorded, tiny, tmp_path):
    weights, metrics = replay(RLOO, recorded[RLOO], tiny, tmp_path, "--off-policy-correction", "behaviour")
    expected_weights, expected = weights_and_metrics(recorded[RLOO])
    assert [m["objective/scores"] for m in metrics] == [m["objective/scores"] for m in expected]
    assert [m["async/staleness"] for m in metrics] == [0, 1, 2, 2]
    # the recorded paper mode's ratio is 1 at every step (one update per step); behaviour's is pi / mu, off 1 once the
    # batch is stale
    assert all(m["policy/importance_ratio_mean"] == pytest.approx(1.0, abs=1e-6) for m in expected)
    assert abs(metrics[-1]["policy/importance_ratio_mean"] - 1.0) > 1e-3
    assert any(not torch.equal(weights[name], expected_weights[name]) for name in weights)


def test_two_learner_processes_replay_the_stream_like_one(recorded, tiny, tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, _ = replay(RLOO, recorded[RLOO], tiny, tmp_path / "one")
    two, metrics = replay(RLOO, recorded[RLOO], tiny, tmp_path / "two",
                          launch=lambda script, cwd, *args: torchrun(REPO / script, cwd, *args))
    # gradients are averaged over the ranks: the same sums in another order, equal to float32 rounding
    assert max((one[name] - two[name]).abs().max().item() for name in one) < 1e-5
    assert len(metrics) == STEPS


@pytest.mark.parametrize("change,message", [
    (dict(num_learner_steps=STEPS + 1), f"--replay-from '.*' holds {STEPS} recorded learner steps, fewer than "
                                        f"--num-learner-steps {STEPS + 1}"),
    (dict(prompts_per_step=2), "--replay-from: --prompts-per-step is 2 here but was 4 in the recorded run"),
    (dict(num_samples_per_prompt=4), "--replay-from: --num-samples-per-prompt is 4 here but was 2 in the recorded run"),
    (dict(temperature=1.0), "--replay-from: --temperature is 1.0 here but was 0.7 in the recorded run"),
    (dict(model_name_or_path="neox_policy"), "--replay-from: --model-name-or-path is '.*neox_policy' here but"),
    (dict(resume_from="somewhere"), "--replay-from does not go with --resume-from or --save-every yet"),
    (dict(replay_from="no_samples"), "--replay-from '.*no_samples' holds no recorded samples"),
])
def test_a_replay_that_cannot_be_the_recorded_run_is_refused_in_one_line(recorded, tiny, tmp_path, change, message):
    rloo = load_script(RLOO)
    values = {**dict(prompts_per_step=4, num_samples_per_prompt=2, num_learner_steps=STEPS, async_steps=2), **change}
    values["model_name_or_path"] = str(tiny / change.get("model_name_or_path", "policy"))
    values["replay_from"] = str(tmp_path / change["replay_from"]) if "replay_from" in change else str(recorded[RLOO])
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        rloo.check_replay(rloo.Args(**values))


def test_another_scripts_samples_are_refused_before_any_model_loads(recorded, tiny, tmp_path, cli):
    proc = cli(DPO, tmp_path, *flags(tiny, "--replay-from", str(recorded[RLOO])))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == ("error: --replay-from: the script is 'async_dpo_multigpu.py' here "
                                                    "but was 'async_rloo_multigpu.py' in the recorded run")
    assert "Traceback" not in proc.stderr and not re.search("Loading weights|Initializing", proc.stderr + proc.stdout)
