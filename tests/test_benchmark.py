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
