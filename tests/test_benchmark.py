"""benchmark/: the --quick mode of every benchmark command runs end to end on tiny models, so the pipeline
cannot rot."""

import re

from conftest import run_script


def test_speed_benchmark_quick_mode_writes_table_and_plot(tiny, tmp_path):
    results = tmp_path / "results"
    flags = ("--quick", "--algorithms", "dpo", "--policy", str(tiny / "policy"), "--reward-model", str(tiny / "rm"),
             "--prompts", str(tiny / "prompts.jsonl"), "--results-dir", str(results),
             "--work-dir", str(tmp_path / "work"))
    proc, _ = run_script("benchmark/speed.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = (results / "speed.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| dpo |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(cells[i]) > 0 for i in (1, 2, 3)), row  # seconds per step of the three runs
    assert re.fullmatch(r"[\d.]+x", cells[4]) and re.fullmatch(r"[\d.]+x", cells[8])
    assert (results / "speed.png").stat().st_size > 1000
    assert sorted(p.name for p in (results / "speed").iterdir()) == [
        "dpo__async.json", "dpo__sync.json", "dpo__sync_split.json"]
    # a second invocation skips the finished runs and only rebuilds the report
    again, _ = run_script("benchmark/speed.py", tmp_path, *flags, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done already") == 3
    # finished runs that timed other steps are refused, not reused
    longer, _ = run_script("benchmark/speed.py", tmp_path, *flags, "--measured-steps", "5", timeout=300)
    assert longer.returncode != 0
    assert "was made with 1 warm-up + 2 measured steps" in longer.stderr


def test_memory_benchmark_quick_mode_writes_table_breakdown_and_plot(tiny, arithmetic_folder, tmp_path):
    results = tmp_path / "results"
    flags = ("--quick", "--policy", str(tiny / "policy"), "--dataset-path", str(arithmetic_folder),
             "--results-dir", str(results), "--work-dir", str(tmp_path / "work"))
    proc, _ = run_script("benchmark/memory.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = (results / "memory.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in table.splitlines() if line.startswith("| p2_m")}
    assert set(rows) == {"p2_m4", "p2_m32"}
    # peak RSS of a real run: at least the libraries and the 1 GiB KV cache, far from the machine's 24 GiB
    assert all(1.0 < float(cells[5]) < 20 for cells in rows.values())
    breakdown = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()
                 if line.startswith("| ")}
    assert 0.3 < float(breakdown["libraries, data (torch, transformers, vLLM)"]) < 3
    assert float(breakdown["measured: after the engine is built"]) > float(breakdown["measured: after the models load"])
    assert "| grpo, GSM8K | Rho-1B |" in table  # the computed GPU table
    assert (results / "memory.png").stat().st_size > 1000
    again, _ = run_script("benchmark/memory.py", tmp_path, *flags, timeout=300)  # finished runs are reused
    assert again.returncode == 0 and again.stdout.count("done already") == 2
