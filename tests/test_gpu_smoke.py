"""benchmark/gpu_smoke.sh: its CPU mode (tiny models it builds itself) runs every check end to end, so the GPU smoke
test cannot rot before the first GPU runs it."""

import importlib.util
import subprocess

import pytest

from conftest import ENV, REPO, kill_group

TORCH_CHECKS = [
    f"torch: {what} ({model})"
    for model in ("pythia", "qwen")
    for what in ("learner memory", "grad == no-grad", "TF32 sensitivity")
] + ["torch: peak vs estimate (pythia)"]
RUNS = [
    "dpo (pythia)",
    "rloo (pythia)",
    "ppo (pythia)",
    "dpo (pythia), engine TF32",
    "dpo engine in own process (torchrun 1)",
    "dpo engine in own process (torchrun 2)",
    "grpo (arithmetic, qwen)",
]


@pytest.mark.slow
def test_gpu_smoke_cpu_mode_passes_every_check(tmp_path):
    proc = subprocess.Popen(
        ["bash", str(REPO / "benchmark" / "gpu_smoke.sh"), "--cpu", "--work-dir", str(tmp_path / "work")],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=1800)  # ~4-7 min on 2 cores; generous for a loaded machine
    finally:
        kill_group(proc)
    assert proc.returncode == 0, output[-6000:]
    lines = output.splitlines()
    for check in TORCH_CHECKS + RUNS:
        assert any(line.startswith(f"PASS  {check}:") for line in lines), (check, output[-4000:])
    assert f"{len(TORCH_CHECKS + RUNS)} PASS, 0 FAIL, 0 SKIP" in output
    # the table's row of each run shows the step-0 gap (engine vs learner, policy version 0) and a weight sync time
    for check in RUNS:
        row = next(line for line in lines if line.startswith(check + " "))
        cells = row[len(check) :].split()
        assert cells[0] == "PASS" and float(cells[1]) < 1e-3, row
    # the peak at both micro-batches is within the multigpu variants' estimate, and the 1-rank torchrun run had an
    # engine process beside the agent and its rank; on CPU an inherited TRITON_F32_DEFAULT=tf32 changes nothing
    fit = next(line for line in lines if line.startswith("PASS  torch: peak vs estimate (pythia):"))
    assert "M 2: peak" in fit and "M 8: peak" in fit and "per sequence" in fit, fit
    one_rank = next(line for line in lines if line.startswith("PASS  dpo engine in own process (torchrun 1):"))
    assert "EngineCore" in one_rank, one_rank
    assert "must change nothing" in next(line for line in lines if line.startswith("PASS  dpo (pythia), engine TF32"))


def load_smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "benchmark" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_weight_configs_are_the_hub_models_shapes(tmp_path):
    """--random-weights builds the GPU models from configs the smoke writes: each must give the hub model's exact
    parameter count (Pythia-160m, Qwen2.5-0.5B-Instruct and Pythia-2.8b as published), and --cpu's tiny ones the same
    two families; built on the meta device, so no memory is spent."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    smoke = load_smoke()
    published = {
        "pythia-160m": ("GPTNeoXForCausalLM", 162_322_944),
        "qwen2.5-0.5b": ("Qwen2ForCausalLM", 494_032_768),
        "pythia-2.8b": ("GPTNeoXForCausalLM", 2_775_208_960),
        "pythia": ("GPTNeoXForCausalLM", None),
        "qwen": ("Qwen2ForCausalLM", None),
    }
    for cpu in (False, True):
        folders = smoke.write_random_configs(tmp_path / str(cpu), cpu)
        assert len(folders) == (2 if cpu else 3)
        for name, folder in folders.items():
            assert sorted(p.name for p in folder.iterdir()) == ["config.json"] and not smoke.has_weights(str(folder))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
            kind, count = published[name]
            assert type(model).__name__ == kind, name
            assert count is None or sum(p.numel() for p in model.parameters()) == count, name


@pytest.mark.slow
def test_gpu_smoke_random_weight_mode_needs_no_model_files(tmp_path):
    """The torch part from written configs alone (the device's command: --only torch --random-weights; here with
    --cpu's tiny configs): every torch check passes with model paths that do not exist, and the flag without
    --only torch is refused in one line before anything is built."""
    env = {
        **ENV,
        "PYTHIA": str(tmp_path / "none"),
        "QWEN": str(tmp_path / "none"),
        "PYTHIA_BIG": str(tmp_path / "none"),
    }
    command = ["bash", str(REPO / "benchmark" / "gpu_smoke.sh"), "--cpu", "--random-weights"]
    refused = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
        "error: --random-weights needs --only torch: the runs need the models' tokenizers and weights"
    ], refused.stderr
    work = tmp_path / "work"
    proc = subprocess.run(
        [*command, "--only", "torch", "--work-dir", str(work)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    for check in TORCH_CHECKS:
        assert any(line.startswith(f"PASS  {check}:") for line in lines), (check, proc.stdout[-4000:])
    assert f"{len(TORCH_CHECKS)} PASS, 0 FAIL, 0 SKIP" in proc.stdout
    memory = [line for line in lines if line.startswith("PASS  torch: learner memory")]
    assert len(memory) == 2 and all("random weights from config.json alone" in line for line in memory), memory
    assert not any(work.glob("**/*.safetensors")) and not (work / "models").exists()
