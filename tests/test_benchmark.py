"""benchmark/: the --quick mode of every benchmark command runs end to end on tiny models, so the pipeline
cannot rot."""

import json
import re

import pytest

from conftest import REPO, run_script


@pytest.mark.slow
def test_speed_benchmark_quick_mode_writes_table_and_plot(tiny, tmp_path):
    results = tmp_path / "results"
    flags = (
        "--quick",
        "--settings",
        "dpo",
        "--policy",
        str(tiny / "policy"),
        "--reward-model",
        str(tiny / "rm"),
        "--prompts",
        str(tiny / "prompts.jsonl"),
        "--results-dir",
        str(results),
        "--work-dir",
        str(tmp_path / "work"),
    )
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
    assert sorted(p.name for p in (results / "runs").iterdir()) == [
        "dpo__async.json",
        "dpo__sync.json",
        "dpo__sync_split.json",
    ]
    # a second invocation skips the finished runs and only rebuilds the report
    again, _ = run_script("benchmark/speed.py", tmp_path, *flags, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done already") == 3, again.stderr[-3000:]
    # finished runs that timed other steps are refused, not reused
    longer, _ = run_script("benchmark/speed.py", tmp_path, *flags, "--measured-steps", "5", timeout=300)
    assert longer.returncode != 0
    assert "was made with 1 warm-up + 2 measured steps" in longer.stderr
    # the LoRA variant's async run beside the core's, which is reused (issue 56): its own table, shares in percent
    lora, _ = run_script("benchmark/speed.py", tmp_path, *flags, "--variants", "async", "async_lora", timeout=1800)
    assert lora.returncode == 0 and lora.stdout.count("done already") == 1, lora.stderr[-3000:]
    text = (results / "speed.md").read_text()
    row = text.split("LoRA (issue 56)")[1].splitlines()[4]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "dpo" and re.fullmatch(r"[\d.]+% / [\d.]+%", cells[6]) and cells[7] == "1 x 2", row
    assert all(float(x) > 0 for x in cells[1].split(" / ")), row


@pytest.mark.slow
def test_memory_benchmark_quick_mode_writes_table_breakdown_and_plot(tiny, arithmetic_folder, tmp_path):
    results = tmp_path / "results"
    flags = (
        "--quick",
        "--policy",
        str(tiny / "policy"),
        "--dataset-path",
        str(arithmetic_folder),
        "--results-dir",
        str(results),
        "--work-dir",
        str(tmp_path / "work"),
    )
    proc, _ = run_script("benchmark/memory.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = (results / "memory.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in table.splitlines() if line.startswith("| p2_m")}
    assert set(rows) == {"p2_m4", "p2_m32"}
    # peak RSS of a real run: at least the libraries and the 1 GiB KV cache, far from the machine's 24 GiB
    assert all(1.0 < float(cells[5]) < 20 for cells in rows.values())
    breakdown = {
        line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines() if line.startswith("| ")
    }
    assert 0.3 < float(breakdown["libraries, data (torch, transformers, vLLM)"]) < 3
    assert float(breakdown["measured: after the engine is built"]) > float(breakdown["measured: after the models load"])
    # the script's own estimate of one micro-batch, read from its output, is a part of the sum
    assert all(float(cells[6]) > 0 for cells in rows.values())
    assert float(breakdown["one micro-batch's activations and logits"]) == float(rows["p2_m4"][6])
    assert 0.3 < float(breakdown["peak / sum (goal <= 1.2)"]) < 3
    assert (results / "memory.png").stat().st_size > 1000
    again, _ = run_script("benchmark/memory.py", tmp_path, *flags, timeout=300)  # finished runs are reused
    assert again.returncode == 0 and again.stdout.count("done already") == 2


@pytest.mark.slow
def test_inflight_benchmark_runs_pairs_resumes_and_refuses_a_mixed_table(tiny, arithmetic_folder, tmp_path):
    """benchmark/inflight.py on the tiny policy: the core and `fixed` for one seed, then a rerun that runs nothing, and
    one with other flags, which must refuse rather than mix its runs into the table."""
    flags = (
        "--policy",
        str(tiny / "policy"),
        "--dataset-path",
        str(arithmetic_folder),
        "--no-chat-template",
        "--settings",
        "core",
        "fixed",
        "--seeds",
        "1",
        "--num-learner-steps",
        "3",
        "--warmup-steps",
        "1",
        "--response-length",
        "16",
        "--max-prompt-tokens",
        "256",
        "--chunk",
        "4",
        "--num-eval-prompts",
        "4",
        "--results-dir",
        str(tmp_path),
        "--work-dir",
        str(tmp_path / "work"),
    )
    proc, _ = run_script("benchmark/inflight.py", tmp_path, *flags, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "inflight.md").read_text().split("Per run:")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert {"core", "fixed"} <= set(rows) and (tmp_path / "inflight.png").stat().st_size > 0
    fixed = json.loads((tmp_path / "runs" / "fixed__seed1.json").read_text())
    assert any(m["async/mixed_version_share"] > 0 for m in fixed["metrics"])  # versions did enter in flight
    assert rows["core"].split(" | ")[-1].startswith("1.000 [1.000-1.000]")  # the core against itself
    again, _ = run_script("benchmark/inflight.py", tmp_path, *flags, timeout=300)
    assert again.returncode == 0 and "== " not in again.stdout  # nothing rerun
    other, _ = run_script("benchmark/inflight.py", tmp_path, *flags, "--chunk", "8", timeout=300)
    assert other.returncode != 0 and "was made with other flags" in other.stderr
    gap, _ = run_script(
        "benchmark/inflight.py",
        tmp_path,
        *flags,
        "--kv-gap",
        "--kv-swap-step",
        "4",
        "--learning-rate",
        "0.01",
        "--results-dir",
        str(tmp_path / "kv"),  # a new folder (issue 55: --kv-gap crashed there after its measurement)
        timeout=600,
    )
    assert gap.returncode == 0, gap.stderr[-3000:]
    measured = json.loads((tmp_path / "kv" / "inflight_kv.json").read_text())
    assert measured["recompute"]["max_gap"] < 1e-4 < measured["keep"]["mean_gap"]  # recomputed KV: version 1 exactly
    assert "| keep |" in (tmp_path / "kv" / "inflight_kv.md").read_text()


@pytest.mark.parametrize(
    "flags,message",
    [
        (  # no swap happened, yet the table compared keep with recompute
            ("--kv-gap", "--kv-swap-step", "-1"),
            "--kv-swap-step must be >= 1 and below --response-length 192 (the swap happens after that many decoding "
            "steps), got -1",
        ),
        (  # refused by the script after the core's whole run
            ("--chunk", "0"),
            "--chunk must be >= 1 and below --response-length 192 (fixed takes the next version after that many "
            "decoding steps), got 0",
        ),
        (
            ("--num-eval-prompts", "0"),
            "--num-eval-prompts must be >= 1 (the table's accuracy columns), got 0",
        ),  # KeyError
    ],
)
def test_inflight_benchmark_refuses_bad_flags_in_one_line_before_any_run(tmp_path, cli, flags, message):
    """Issue 55: each of these ran (a model, an engine, whole runs) before it failed or wrote a wrong table."""
    results, work = tmp_path / "results", tmp_path / "work"
    proc = cli("benchmark/inflight.py", tmp_path, *flags, "--results-dir", str(results), "--work-dir", str(work))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f"error: {message}"], proc.stderr[-3000:]
    assert not work.exists() and not results.exists()


@pytest.mark.slow
def test_gpu_fit_table_is_what_the_variants_compute_and_every_paper_config_fits_under_fsdp2(tmp_path):
    """Issue 44: benchmark/results/gpu_fit/gpu_fit.md is the variants' own choice of micro-batch on an 80 GiB card (the
    tool re-run gives the committed table, to the character), and each paper configuration fits some 1 + 3 layout: every
    row's FSDP2 cell holds a micro-batch of at least 1, and a config the estimate cannot fit is refused, not run."""
    proc, _ = run_script(
        "benchmark/gpu_fit.py",
        tmp_path,
        "--results-dir",
        str(tmp_path / "results"),
        "--work-dir",
        str(tmp_path / "work"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "results" / "gpu_fit.md").read_text()
    assert table == (REPO / "benchmark" / "results" / "gpu_fit" / "gpu_fit.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| DPO", "| RLOO", "| PPO", "| GRPO"))]
    assert len(rows) == 12
    assert all(re.match(r"\d+ of \d+ \(", row[-1]) and int(row[-1].split()[0]) >= 1 for row in rows)
    ppo_28b = next(row for row in rows if row[0] == "| PPO" and row[1] == "Pythia-2.8b")
    assert ppo_28b[3].startswith("**refused**") and ppo_28b[5].startswith("**refused**")  # 1 GPU, 1 + 3 DDP
