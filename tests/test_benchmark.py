"""benchmark/: the --quick mode of every benchmark command runs end to end on tiny models, so the pipeline
cannot rot."""

import json
import os
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
def test_overheads_benchmark_quick_mode_times_every_piece(tiny, tmp_path):
    import torch

    results = tmp_path / "results"
    proc, _ = run_script(
        "benchmark/overheads.py",
        tmp_path,
        "--quick",
        "--policy",
        str(tiny / "policy"),
        "--neox-policy",
        str(tiny / "neox_policy"),
        "--prompts",
        str(tiny / "prompts.jsonl"),
        "--max-prompt-tokens",
        "64",
        "--response-length",
        "16",
        "--results-dir",
        str(results),
        "--work-dir",
        str(tmp_path / "work"),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    pieces, rest = (results / "overheads.md").read_text().split("Generation throughput")
    throughput, push = rest.split("## Push paths")
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in pieces.splitlines() if line.startswith("| ")}
    rates = {
        line.split("|")[1].strip(): line.split("|")[2:-1] for line in throughput.splitlines() if line.startswith("| ")
    }
    for piece in (
        "learner: weight_check (guard)",
        "learner: copy_for_engine, into a loaded copy",
        "learner: copy_for_engine, fresh",
        "hand-off: a batch through the queue",
        "engine: push_weights_to_engine",
        "engine: check_weight_sync (guard)",
        "generate: ours",
    ):
        median, low, high = (float(c) for c in rows[piece])
        assert 0 < low <= median <= high, (piece, rows[piece])
    # throughput of every call, and ours against each (ours against itself is 1)
    assert float(rates["generate: ours"][0]) > 0 and float(rates["generate: ours"][1]) == 1.0
    assert 0.2 < float(rates["generate: bare, same seeds"][1]) < 5
    # the push paths, on both models: the scripts' reload_weights serves W' and costs more than the copy floor
    push_rows = ([c.strip() for c in line.strip("|").split("|")] for line in push.splitlines())
    paths = {(cells[0], cells[1]): cells for cells in push_rows if cells[1:] and cells[1].startswith("(")}
    assert len(paths) == 8, push
    for model in ("policy", "neox_policy"):
        reload, floor = paths[model, "(a) reload_weights"], paths[model, "(d) floor: copy into preallocated tensors"]
        assert reload[6] == "yes" and float(reload[4]) > 1 and float(floor[2]) > 0, (reload, floor)
        if not torch.cuda.is_available():
            # vLLM's CPU backend repacks every linear layer after loading and leaves an empty parameter behind: the
            # model's load_weights cannot reach it, and copies into what it can reach serve a mix of W' and W
            for name in ("(b) load_weights", "(c) in-place copy_"):
                assert paths[model, name][6] == "**no**" and "raises" in paths[model, name][8], paths[model, name]
            assert float(re.search(r"gap to that mix ([\d.e+-]+)", paths[model, "(c) in-place copy_"][8])[1]) < 1e-4


@pytest.mark.slow
def test_learner_cost_quick_mode_gives_every_algorithm_a_finite_ratio(tiny, arithmetic_folder, tmp_path):
    import json
    import math

    results = tmp_path / "results"
    flags = (
        "--policy",
        str(tiny / "policy"),
        "--reward-model",
        str(tiny / "rm"),
        "--prompts",
        str(tiny / "prompts.jsonl"),
        "--dataset-path",
        str(arithmetic_folder),
        "--results-dir",
        str(results),
        "--work-dir",
        str(tmp_path / "work"),
    )
    for bad, message in (
        (("--algorithms", "sft"), "unknown --algorithms ['sft']"),
        (("--revisions", "no-such-commit"), "--revisions 'no-such-commit' is neither"),
    ):
        proc, _ = run_script("benchmark/learner_cost.py", tmp_path, *flags, *bad, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr and not results.exists(), proc.stderr[-2000:]
    proc, _ = run_script("benchmark/learner_cost.py", tmp_path, "--quick", *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = (results / "learner_cost.md").read_text()
    summary = {
        cells[0]: cells
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table.splitlines())
        if cells[0] in ("dpo", "rloo", "ppo", "grpo_gsm8k")
    }
    assert set(summary) == {"dpo", "rloo", "ppo", "grpo_gsm8k"}, table
    for algo, cells in summary.items():
        minimal, body, learner = float(cells[2]), float(cells[4]), float(cells[5])
        ratio = float(cells[6].rstrip("x"))
        assert 0 < minimal and 0 < body < learner and math.isfinite(ratio) and ratio > 0, cells
        assert cells[7] in ("met", "not met")
    result = json.loads((results / "learner_cost.json").read_text())
    for algo, a in result["algorithms"].items():
        # the in-process rows time the very batches the run trained on: made again, they have its response lengths
        assert [r["response_length"] for r in a["runs"]["worktree"]] == [a["response_length"]], algo
        assert all(t > 0 for name, times in a["seconds"].items() for t in times), (algo, a["seconds"])
        assert ("reference" in a["seconds"]) == (algo != "grpo_gsm8k") and ("values" in a["seconds"]) == (algo == "ppo")
    assert table.count("(the same batches)") == 4
    # step by step, beside the means: a one-off cost in one step shows against its batch's minimal work
    assert table.count("- minimal work per measured step's batch") == table.count("- worktree: loop body per") == 4


@pytest.mark.slow
def test_corrections_toy_gradient_is_exact_and_its_report_is_written(tmp_path):
    """benchmark/corrections_toy.py: its J and grad J equal brute-force enumeration on a toy small enough to list every
    sequence, its per-term gradient formula sums to grad J, and a short run writes the table."""
    import itertools
    import math

    import pytest
    import torch

    from conftest import load_script

    toy = load_script("benchmark/corrections_toy.py")
    length, vocab, threshold = 3, 3, 2
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(length, vocab, vocab, generator=g, dtype=torch.float64).requires_grad_(True)
    succ = torch.tensor([1, 2, 0])
    tokens = torch.tensor(list(itertools.product(range(vocab), repeat=length + 1)))  # every prompt and response
    logp = toy.token_logprobs(toy.policy_logprobs(theta), tokens).sum(1) - math.log(vocab)  # the prompt: uniform
    rewards = toy.rewards_of(tokens, succ, threshold)
    enumerated = (logp.exp() * rewards).sum()
    exact = toy.exact_objective(theta, succ, threshold)
    assert exact.item() == pytest.approx(enumerated.item(), rel=1e-12)
    (grad_exact,) = torch.autograd.grad(exact, theta)
    (grad_enumerated,) = torch.autograd.grad(enumerated, theta)
    assert torch.allclose(grad_exact, grad_enumerated, atol=1e-12)
    # sum_y p(y) r(y) sum_t grad log pi(y_t | y_t-1) is grad J: the formula every estimator of the toy uses
    weights = (logp.exp() * rewards).detach()[:, None].expand(-1, length) * len(tokens)
    per_term = toy.gradient_estimates(theta.detach(), tokens, weights, len(tokens))[0]
    assert torch.allclose(per_term, grad_exact.flatten(), atol=1e-12)

    output = tmp_path / "toy.md"
    proc, _ = run_script(
        "benchmark/corrections_toy.py",
        tmp_path,
        "--seeds",
        "1",
        "--learning-rates",
        "0.03",
        "--expectation-samples",
        "65536",
        "--output",
        str(output),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
        for line in output.read_text().splitlines()
        if line.startswith("| ") and "±" in line
    }
    assert set(rows) == set(toy.MODES)
    value = lambda mode, column: float(rows[mode][column].split(" ± ")[0])
    assert value("on-policy", 1) < 0.25  # relative error of the on-policy expectation: sampling noise only
    assert value("behaviour", 3) > 0.1 and value("paper", 3) == 0.0  # the clip drops whole sequences


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


@pytest.mark.slow
def test_lora_handoff_quick_mode_measures_both_hand_offs_and_generation_through_the_adapter(tiny, tmp_path):
    """benchmark/lora_handoff.py on the tiny Llama from the working tree: one row per mode with the bytes each hands
    over (the adapter fewer), the generation table with tokens from every mode, the calculation's tables."""
    results = tmp_path / "results"
    flags = ("--quick", "--ranks", "1", "--policy", str(tiny / "policy"), "--scripts-ref", "")
    flags += ("--results-dir", str(results), "--work-dir", str(tmp_path / "work"))
    proc, _ = run_script("benchmark/lora_handoff.py", tmp_path, *flags, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((results / "lora_handoff.json").read_text())
    modes = result["modes"]
    assert list(modes) == ["full", "lora-1"]
    assert not os.path.exists(modes["lora-1"]["adapter_dir"])  # its adapters' folder in /dev/shm (RAM): removed
    assert modes["lora-1"]["rows"][-1]["bytes"] < modes["full"]["rows"][-1]["bytes"] / 10
    for mode in modes.values():
        assert len(mode["rows"]) == 2 and len(mode["generation"]) == 1, mode
        assert mode["generation"][0]["tokens"] > 0 and mode["generation"][0]["sequences"] == 4, mode["generation"]
    text = (results / "lora_handoff.md").read_text()
    assert "| full | " in text and "| lora-1 | " in text and "## Generation through the adapter" in text
    assert re.search(r"\| lora-1 \| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", text), text
    assert "## By calculation" in text and "| Llama-3.1-8B |" in text
