"""Record and replay (docs/multigpu.md#record-and-replay): the batches a run trained on (--record-samples), trained on
again without an engine (--replay-from). With the run's own flags the replay trains the very same weights, bit for bit;
under another --off-policy-correction, other weights from the same samples; under torchrun, the same weights to float
rounding, and logs the gap of one process; and a replay that cannot be the recorded run, or is given a flag it would
ignore, is refused in one line before any model loads. Real engine for the recordings, tiny models."""

import json
import re

import pytest
import torch
import tyro
from safetensors.torch import load_file
from test_distributed import torchrun

from conftest import ENV, REPO, load_script, read_metrics, run_script

pytestmark = pytest.mark.slow  # every test here needs the recordings: two runs on the engine

RLOO, DPO = "multigpu/async_rloo_multigpu.py", "multigpu/async_dpo_multigpu.py"
STEPS = 4
# what vLLM logs at INFO level when it builds an engine (vllm/v1/engine/core.py): the recordings log it, a replay not
ENGINE_LOG = "Initializing a V1 LLM engine"


def flags(tiny, *extra):
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
        "--num-learner-steps",
        str(STEPS),
        "--learning-rate",
        "3e-3",
        "--seed",
        "5",
        "--async-steps",
        "2",
        "--micro-batch-size",
        "4",
        "--kv-cache-gib",
        "0.25",
        *extra,
    )


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    """{script: its run folder}: K = 2 runs on the real engine with --record-samples (DPO for two steps)."""
    runs = {}
    for script, steps in ((RLOO, STEPS), (DPO, 2)):
        cwd = tmp_path_factory.mktemp("record")
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(ENV, "VLLM_LOGGING_LEVEL", "INFO")  # so that the engine's start shows: see ENGINE_LOG
            proc, _ = run_script(script, cwd, *flags(tiny, "--record-samples", "--num-learner-steps", str(steps)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ENGINE_LOG in proc.stdout + proc.stderr
        (runs[script],) = (cwd / "runs").iterdir()
    return runs


def replay(script, run, tiny, cwd, *extra, launch=run_script):
    """Replay `run` with the run's flags and `extra`; returns (final weights, metrics, stdout), having checked that it
    built no engine (vLLM's INFO log says when it does: ENGINE_LOG) and says it is a replay in its summary."""
    steps = str(STEPS if script == RLOO else 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(ENV, "VLLM_LOGGING_LEVEL", "INFO")
        proc, _ = launch(script, cwd, *flags(tiny, "--replay-from", str(run), "--num-learner-steps", steps, *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ENGINE_LOG not in proc.stdout + proc.stderr
    assert f"replay of:   {run} (trained on its recorded batches" in proc.stdout
    (folder,) = (cwd / "runs").iterdir()
    return load_file(folder / "model" / "model.safetensors"), read_metrics(cwd), proc.stdout


def weights_and_metrics(run):
    return load_file(run / "model" / "model.safetensors"), [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.parametrize("script", [RLOO, DPO])
def test_a_replay_with_the_runs_own_flags_trains_the_same_weights_bit_for_bit(recorded, tiny, tmp_path, script):
    run = recorded[script]
    steps = STEPS if script == RLOO else 2
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["meta.json"] + [
        f"step_{i:06d}.pt" for i in range(steps)
    ]
    weights, metrics, _ = replay(script, run, tiny, tmp_path)
    expected_weights, expected = weights_and_metrics(run)
    initial = load_file(tiny / "policy" / "model.safetensors")
    assert any(not torch.equal(expected_weights[name], initial[name]) for name in initial)  # the run did train
    # the same float32 operations in the same order on the same inputs: the learner thread shares its process with the
    # engine in the recorded run only, and no learner computation depends on it
    assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
    for replayed, original in zip(metrics, expected, strict=True):  # async/ too: the recorded versions
        assert {k: v for k, v in replayed.items() if not k.startswith("time/")} == {
            k: v for k, v in original.items() if not k.startswith("time/")
        }
        assert replayed["time/generation"] == replayed["time/weight_sync"] == 0.0
    if script == RLOO:
        assert [m["async/actor_version"] for m in metrics] == [0, 0, 0, 1]  # max(0, i - K), K = 2


def test_a_replay_under_another_correction_trains_on_the_same_samples_to_other_weights(recorded, tiny, tmp_path):
    weights, metrics, _ = replay(RLOO, recorded[RLOO], tiny, tmp_path, "--off-policy-correction", "behaviour")
    expected_weights, expected = weights_and_metrics(recorded[RLOO])
    assert [m["objective/scores"] for m in metrics] == [m["objective/scores"] for m in expected]
    assert [m["async/staleness"] for m in metrics] == [0, 1, 2, 2]
    # the recorded paper mode's ratio is 1 at every step (one update per step); behaviour's is pi / mu, off 1 once the
    # batch is stale
    assert all(m["policy/importance_ratio_mean"] == pytest.approx(1.0, abs=1e-6) for m in expected)
    assert abs(metrics[-1]["policy/importance_ratio_mean"] - 1.0) > 1e-3
    assert any(not torch.equal(weights[name], expected_weights[name]) for name in weights)


def test_two_learner_processes_replay_the_stream_like_one(recorded, tiny, tmp_path):
    """Against the recorded run itself (which a one-process replay repeats bit for bit, as tested above): the weights to
    float rounding, and the logprob gap, now over every micro-batch before the step's first update on every rank, per
    token: taken on each rank's first micro-batch, the same data gave another gap on two ranks than on one."""
    two, metrics, _ = replay(
        RLOO, recorded[RLOO], tiny, tmp_path, launch=lambda script, cwd, *args: torchrun(REPO / script, cwd, *args)
    )
    one, expected = weights_and_metrics(recorded[RLOO])
    # gradients are averaged over the ranks: the same sums in another order, equal to float32 rounding
    assert max((one[name] - two[name]).abs().max().item() for name in one) < 1e-5
    assert len(metrics) == STEPS
    gap = "async/behaviour_learner_logprob_gap"
    assert expected[-1][gap] > 1e-2  # the batches of steps 1-3 are stale (K = 2): far more than rounding
    assert [m[gap] for m in metrics] == pytest.approx([m[gap] for m in expected], rel=1e-4, abs=1e-9)


def cli_flags(tiny, run, *change):
    """The recorded run's flags with --replay-from `run`, each flag of `change` (pairs) in place of the run's."""
    values = dict(zip(*[iter(flags(tiny, "--replay-from", str(run)))] * 2))
    values.update(zip(*[iter(change)] * 2))
    return [item for pair in values.items() for item in pair]


REFUSED = "in the recorded run, which a replay cannot change \\(docs/multigpu.md\\)$"


@pytest.mark.parametrize(
    "change,message",
    [
        (
            ("--num-learner-steps", str(STEPS + 1)),
            f"--replay-from '.*' holds {STEPS} recorded learner steps, fewer than --num-learner-steps {STEPS + 1}",
        ),
        (("--resume-from", "somewhere"), "--replay-from does not go with --resume-from or --save-every yet"),
        (("--replay-from", "NO_SAMPLES"), "--replay-from '.*no_samples' holds no recorded samples"),
        # what shaped the samples
        (("--prompts-per-step", "2"), "--replay-from: --prompts-per-step is 2 here but was 4 " + REFUSED),
        (("--num-samples-per-prompt", "4"), "--replay-from: --num-samples-per-prompt is 4 here but was 2 " + REFUSED),
        (("--temperature", "1.0"), "--replay-from: --temperature is 1.0 here but was 0.7 " + REFUSED),
        (
            ("--model-name-or-path", "NEOX"),
            "--replay-from: --model-name-or-path is '.*neox_policy' here but was '.*policy' " + REFUSED,
        ),
        # what a replay does not run (generation, reward, prompts): a new value would change nothing
        (
            ("--missing-eos-penalty", "-2.0"),
            "--replay-from: --missing-eos-penalty is -2.0 here but was -1.0 " + REFUSED,
        ),
        (
            ("--reward-model-path", "NEOX_RM"),
            "--replay-from: --reward-model-path is '.*neox_rm' here but was '.*rm' " + REFUSED,
        ),
        (
            ("--engine-dtype", "bfloat16"),
            "--replay-from: --engine-dtype is 'bfloat16' here but was 'float32' " + REFUSED,
        ),
        # the learner's arithmetic: another micro-batch was 7.7e-7 off the recorded weights
        (("--micro-batch-size", "2"), "--replay-from: --micro-batch-size is 2 here but was 4 " + REFUSED),
        (
            ("--learner-dtype", "bfloat16"),
            "--replay-from: --learner-dtype is 'bfloat16' here but was 'float32' " + REFUSED,
        ),
        (("--torch-threads", "2"), "--replay-from: --torch-threads is 2 here but was 1 " + REFUSED),
        # several: every one named, in one line
        (
            ("--response-length", "8", "--max-prompt-tokens", "32"),
            "--replay-from: --response-length is 8 here but was 16, "
            "--max-prompt-tokens is 32 here but was 64 " + REFUSED,
        ),
    ],
)
def test_a_replay_that_cannot_be_the_recorded_run_is_refused_in_one_line(recorded, tiny, tmp_path, change, message):
    """check_args refuses first (check_replay), before it reads any model's config."""
    rloo = load_script(RLOO)
    paths = {"NEOX": tiny / "neox_policy", "NEOX_RM": tiny / "neox_rm", "NO_SAMPLES": tmp_path / "no_samples"}
    args = tyro.cli(rloo.RunArgs, args=cli_flags(tiny, recorded[RLOO], *(str(paths.get(f, f)) for f in change)))
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        rloo.check_args(args)


def test_a_replay_without_micro_batch_size_takes_the_recorded_one(recorded, tiny):
    rloo = load_script(RLOO)
    flags_ = cli_flags(tiny, recorded[RLOO])
    i = flags_.index("--micro-batch-size")
    args = tyro.cli(rloo.RunArgs, args=flags_[:i] + flags_[i + 2 :])
    assert args.micro_batch_size is None
    rloo.check_replay(args)
    assert args.micro_batch_size == 4


@pytest.mark.parametrize(
    "script,source,extra,line",
    [
        (DPO, RLOO, (), "--replay-from: the script is 'async_dpo_multigpu.py' here but was 'async_rloo_multigpu.py'"),
        (
            DPO,
            DPO,
            ("--missing-eos-penalty", "-2.0", "--learner-dtype", "bfloat16"),
            "--replay-from: --missing-eos-penalty is -2.0 here but was -1.0, --learner-dtype is 'bfloat16' here but was "
            "'float32'",
        ),
    ],
    ids=["another-script", "flags"],
)
def test_a_refused_replay_stops_in_one_line_before_any_model_loads(
    recorded, tiny, tmp_path, cli, script, source, extra, line
):
    proc = cli(script, tmp_path, *cli_flags(tiny, recorded[source], *extra))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {line} in the recorded run, which a replay cannot change (docs/multigpu.md)"
    )
    assert "Traceback" not in proc.stderr and not re.search("Loading weights|Initializing", proc.stderr + proc.stdout)
