"""benchmark/: the --quick mode of every benchmark command runs end to end on tiny models, so the pipeline
cannot rot."""

import re

from conftest import run_script


def test_speed_benchmark_quick_mode_writes_table_and_plot(tiny, tmp_path):
    results = tmp_path / "results"
    flags = ("--quick", "--settings", "dpo", "--policy", str(tiny / "policy"), "--reward-model", str(tiny / "rm"),
             "--prompts", str(tiny / "prompts.jsonl"), "--results-dir", str(results),
             "--work-dir", str(tmp_path / "work"))
    proc, _ = run_script("benchmark/speed.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = (results / "speed.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| dpo |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(cells[i]) > 0 for i in (1, 2, 3)), row  # seconds per step of the three runs
    assert re.fullmatch(r"[\d.]+x", cells[4]) and re.fullmatch(r"[\d.]+x", cells[8])
    assert (results / "speed.png").stat().st_size > 1000 and (results / "speed_balance.png").stat().st_size > 1000
    # the balance table: G and T of the split sync run, and their ratio
    balance = next(line for line in table.splitlines() if line.startswith("| dpo | dpo | 4 x 2 |"))
    g, t, ratio = (float(c) for c in balance.strip("|").split("|")[3:6])
    assert g > 0 and t > 0 and abs(ratio - g / t) < 0.01 + 0.06 * ratio, balance
    assert sorted(p.name for p in (results / "speed").iterdir()) == [
        "dpo__async.json", "dpo__sync.json", "dpo__sync_split.json"]
    # a second invocation skips the finished runs and only rebuilds the report
    again, _ = run_script("benchmark/speed.py", tmp_path, *flags, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done already") == 3, again.stderr[-3000:]
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


def test_overheads_benchmark_quick_mode_times_every_piece(tiny, tmp_path):
    results = tmp_path / "results"
    proc, _ = run_script("benchmark/overheads.py", tmp_path, "--quick", "--policy", str(tiny / "policy"), "--prompts",
                         str(tiny / "prompts.jsonl"), "--max-prompt-tokens", "64", "--response-length", "16",
                         "--results-dir", str(results), "--work-dir", str(tmp_path / "work"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pieces, throughput = (results / "overheads.md").read_text().split("Generation throughput")
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in pieces.splitlines() if line.startswith("| ")}
    rates = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in throughput.splitlines()
             if line.startswith("| ")}
    for piece in ("learner: weight_check (guard)", "learner: copy_for_engine, into a loaded copy",
                  "learner: copy_for_engine, fresh", "hand-off: a batch through the queue",
                  "engine: push_weights_to_engine", "engine: check_weight_sync (guard)", "generate: ours"):
        median, low, high = (float(c) for c in rows[piece])
        assert 0 < low <= median <= high, (piece, rows[piece])
    # throughput of every call, and ours against each (ours against itself is 1)
    assert float(rates["generate: ours"][0]) > 0 and float(rates["generate: ours"][1]) == 1.0
    assert 0.2 < float(rates["generate: bare, same seeds"][1]) < 5
