"""benchmark/gpu_smoke.sh: its CPU mode (tiny models it builds itself) runs every check end to end, so the GPU smoke
test cannot rot before the first GPU runs it."""

import subprocess

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
