"""benchmark/staleness_dpo.py: DPO_RULE on synthetic result files whose verdict is known (the calibration's choice,
the primary test, escapes counted), the run list, the prep check, and the sweep's numbers the rule quotes."""

import json
import re

import pytest

from conftest import REPO, load_script

dpo = load_script("benchmark/staleness_dpo.py")
sweep = dpo.sweep


def keeps(u):  # a sync-1 whose gold rises to update 256 and stays: final 0.57, peak 0.57, gain +0.06
    return 0.51 + 0.06 * min(u, 256) / 256


def falls_by(x):  # a sync-1 that keeps the gain but ends x below its peak at update 256
    return lambda u: keeps(u) + (x if u == 256 else 0.0)


def write(folder, algo, n, seed, win, kl=lambda u: u / 256, beta=None, escape=False):
    """A result file as the sweep writes it: an evaluation every 64 updates, every 128 for sync-128."""
    points = range(0, 513, 128 if n == 128 else 64)
    curve = [dict(updates=u, kl=kl(u), win_rate=win(u), gold=0.6, proxy=0.0) for u in points]
    if escape:
        curve[-1]["kl"] = 9.0  # more than twice the largest KL of these sync-1 runs (2.0)
    run = dict(algorithm=algo, setting=f"sync-{n}", learning_rate=1e-4, seed=seed, curve=curve)
    if beta is None:
        path = folder / sweep.SWEEP_NAME / f"{algo}__sync-{n}__lr0.0001__seed{seed}.json"
    else:
        path, run["beta"] = dpo.result_file(folder, beta, n, seed), beta
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run))


def calibrate(folder, curves, kls=None):
    """The 9 calibration runs: curves[beta] is a win-rate curve, or one per seed."""
    for beta, curve in curves.items():
        for seed in dpo.CALIBRATION_SEEDS:
            win = curve[seed - 1] if isinstance(curve, list) else curve
            write(folder, "dpo", 1, seed, win, (kls or {}).get(beta, lambda u: u / 256), beta=beta)
    return dpo.calibration(dpo.load(folder))


def test_the_runs_are_9_calibration_runs_seed_major_then_29_new_ones():
    assert dpo.calibration_runs() == [(b, 1, s) for s in (1, 2, 3) for b in (0.3, 0.5, 1.0)]
    new = [r for r in dpo.sweep_runs(0.5) if r not in dpo.calibration_runs()]
    assert len(new) == 29 and (0.5, 1, 4) in new
    assert new[:4] == [(0.5, 16, 1), (0.5, 64, 1), (0.5, 128, 1), (0.5, 16, 2)]  # seed-major
    assert dpo.result_file(REPO, 0.3, 1, 1).name == "dpo__sync-1__lr0.0001__beta0.3__seed1.json"
    assert dpo.result_file(REPO, 1.0, 128, 8).name == "dpo__sync-128__lr0.0001__beta1__seed8.json"


def test_calibration_picks_the_smallest_qualifying_beta(tmp_path):
    """0.3's seed 2 ends 0.015 below its peak (no); 0.5 and 1.0 qualify, one of 0.5's seeds 0.008 below (within 0.01):
    0.5, the smaller, is chosen. With a run of 0.3 missing the choice waits."""
    found = calibrate(
        tmp_path, {0.3: [keeps, falls_by(0.015), keeps], 0.5: [keeps, falls_by(0.008), keeps], 1.0: keeps}
    )
    assert [found[b]["qualifies"] for b in dpo.BETAS] == [False, True, True]
    assert dpo.choose(found) == ("chosen", 0.5)
    assert found[0.5]["gain"] == pytest.approx(0.06) and found[0.5]["kl"] == pytest.approx(2.0)
    text = "\n".join(dpo.report(tmp_path))
    assert text.count(dpo.DPO_RULE) == 1 and "Calibration: 9 of 9 runs." in text
    assert "| 0.3 | 2 | 0.570 | 0.585 | 0.015 | +0.060 | 2.00 | no |" in text
    assert "DPO_RULE's choice: beta = 0.5." in text
    dpo.result_file(tmp_path, 0.3, 1, 3).unlink()
    assert dpo.choose(dpo.calibration(dpo.load(tmp_path))) == ("pending", None)


def test_a_beta_with_one_seed_falling_more_than_0_01_from_its_peak_does_not_qualify(tmp_path):
    found = calibrate(tmp_path, {b: [keeps, falls_by(0.012), keeps] for b in dpo.BETAS})
    assert found[0.3]["gain"] == pytest.approx(0.06) and found[0.3]["kl"] == pytest.approx(2.0)  # only the peak fails
    assert dpo.choose(found) == ("undetermined", None)
    assert dpo.choose(calibrate(tmp_path, {b: [keeps, falls_by(0.008), keeps] for b in dpo.BETAS})) == ("chosen", 0.3)


def test_no_qualifying_beta_reads_undetermined(tmp_path):
    """Each beta fails by one criterion alone: 0.3 over-optimises (a seed ends 0.02 below its peak), 0.5 ends at mean
    KL 6 (> 4), 1.0 gains +0.03 (< +0.05)."""
    weak = lambda u: 0.51 + 0.03 * min(u, 256) / 256
    found = calibrate(
        tmp_path, {0.3: [keeps, keeps, falls_by(0.02)], 0.5: keeps, 1.0: weak}, kls={0.5: lambda u: 6 * u / 512}
    )
    assert [found[b]["qualifies"] for b in dpo.BETAS] == [False, False, False]
    assert dpo.choose(found) == ("undetermined", None)
    text = "\n".join(dpo.report(tmp_path))
    assert "DPO_RULE's choice: **undetermined**: no beta qualifies" in text and "| dpo vs ppo |" not in text
    assert not (tmp_path / "staleness_dpo.png").exists()


def wobble(seed):  # per-seed noise of a stale run's drop, summing to 0 over the 8 seeds
    return 0.004 * (1 if seed % 2 else -1)


def sweep_files(folder, dpo_cost, ppo_cost=0.05, dpo_escapes=(), dpo_escape_drop=0.15):
    """The chosen beta's 32 DPO runs (0.5; 0.3 over-optimises) beside the sweep's RLOO and PPO runs: at N >= 16 each
    stale run ends its algorithm's cost below its sync-1 (plus a per-seed wobble); PPO's seed-2 run at N = 128 escapes,
    and so do DPO's of dpo_escapes, those ending dpo_escape_drop below."""
    calibrate(folder, {0.3: falls_by(0.02), 0.5: keeps, 1.0: keeps})
    for seed in sweep.SWEEP_SEEDS:
        for algo, cost in (("dpo", dpo_cost), ("rloo", 0.0), ("ppo", ppo_cost)):
            beta = 0.5 if algo == "dpo" else None
            for n in dpo.DPO_SYNC_N if algo == "dpo" else sweep.SWEEP_SYNC_N:
                escape = n == 128 and ((algo == "ppo" and seed == 2) or (algo == "dpo" and seed in dpo_escapes))
                drop = (dpo_escape_drop if escape and algo == "dpo" else cost + wobble(seed)) if n >= 16 else 0.0
                write(
                    folder,
                    algo,
                    n,
                    seed,
                    lambda u, d=drop: keeps(u) - (d if u >= 128 else 0.0),
                    beta=beta,
                    escape=escape,
                )
    lines = dpo.report(folder)
    status, beta, by_algo = dpo.judge(dpo.load(folder), sweep.paper.load_results(folder, sweep.SWEEP_NAME, 1e-4)[0])
    found = {a: dpo.measures(v) for a, v in by_algo.items()}
    return {r["other"]: r for r in dpo.compare(found, "primary")}, found, "\n".join(lines)


def test_the_primary_test_reads_supported_only_where_dpo_s_drops_at_n_128_are_clearly_smaller(tmp_path):
    """DPO keeps its gain (drops ~0), PPO pays 0.05 on every seed: supported against PPO; RLOO pays nothing, so
    against it the best reading is 'not distinguishable', even where DPO's drops are separated from its. DPO paying
    as PPO does: not supported; paying twice: DPO pays more."""
    tests, found, text = sweep_files(tmp_path, dpo_cost=0.0)
    assert tests["ppo"]["holm"] < 0.05 and dpo.reading(tests["ppo"]) == "**supported**"
    assert dpo.reading(tests["rloo"]) == "not supported: not distinguishable"
    assert found["ppo"]["escapes"] == (1, 8) and found["dpo"]["escapes"] == (0, 8)
    assert tests["ppo"]["theirs"] == pytest.approx(0.05) and len(found["ppo"]["primary"]) == 8  # its escape counted
    assert re.search(r"\| dpo vs ppo \| [+-]0\.000 \| \+0\.050 \| .* \| \*\*supported\*\* \|", text)
    assert "The DPO sweep at beta 0.5 is complete (32 of 32 runs)" in text
    assert re.search(r"\(b\) drop at update 128, N = 128 \| dpo vs ppo \| [+-]0\.000 \| \+0\.050 \|", text)
    assert "(c) deepest dip below 0.5 (min win-rate - 0.5), N = 128 | dpo vs ppo | +0.010 | -0.010 |" in text
    assert (tmp_path / "staleness_dpo.png").exists()
    dpo.result_file(tmp_path, 0.5, 128, 8).unlink()
    text = "\n".join(dpo.report(tmp_path))
    assert "is not complete (31 of 32 runs): no verdict is read from it yet" in text and "| pending |" in text

    tests = sweep_files(tmp_path, dpo_cost=0.05)[0]
    assert dpo.reading(tests["ppo"]) == "not supported: not distinguishable"
    tests = sweep_files(tmp_path, dpo_cost=0.10)[0]
    assert dpo.reading(tests["ppo"]) == "not supported: DPO pays more"
    # DPO's stale runs ending above its own sync-1 are separated from RLOO's zero, but RLOO pays nothing to keep
    tests = sweep_files(tmp_path, dpo_cost=-0.03)[0]
    assert tests["rloo"]["holm"] < 0.05 and tests["rloo"]["dpo"] < tests["rloo"]["theirs"]
    assert dpo.reading(tests["rloo"]) == "not supported: not distinguishable (the other pays nothing)"


def test_escaped_runs_count_in_the_primary_test(tmp_path):
    """DPO keeps its gain on 5 seeds, but its sync-128 runs of seeds 2, 4, 6 escape and end 0.15 below: counted, its
    mean drop (~0.058) exceeds PPO's 0.05 and the claim is not supported; the sweep's own tables, which leave escaped
    runs out of the means, would have read DPO's drop as ~0."""
    tests, found, _ = sweep_files(tmp_path, dpo_cost=0.0, dpo_escapes=(2, 4, 6))
    assert found["dpo"]["escapes"] == (3, 8) and len(found["dpo"]["primary"]) == 8
    assert tests["ppo"]["dpo"] == pytest.approx((3 * 0.15 + sum(wobble(s) for s in (1, 3, 5, 7, 8))) / 8)
    assert dpo.reading(tests["ppo"]) != "**supported**"
    runs = {("dpo", f"sync-{n}"): list(rs.values()) for n, rs in dpo.load(tmp_path)[0.5].items()}
    assert len(sweep.verdicts(runs)["dpo"]["per_n"][128]["drops"]) == 5  # the sweep's way leaves them out


def test_the_rule_quotes_the_sweep_s_own_numbers_at_n_128():
    """RLOO's and PPO's drops at N = 128 over all 8 runs, as the committed sweep's result files give them."""
    runs = sweep.paper.load_results(REPO / "benchmark" / "results", sweep.SWEEP_NAME, 1e-4)[0]
    for algo, quoted, escapes in (("rloo", "drop -0.007 ± 0.010", 0), ("ppo", "pays +0.034 ± 0.014", 4)):
        by_n = {n: {r["seed"]: r for r in runs[(algo, f"sync-{n}")]} for n in dpo.DPO_SYNC_N}
        found = dpo.measures(by_n)
        number = "{:+.3f} ± {:.3f}".format(*sweep.paper.mean_ci(found["primary"]))
        assert quoted.endswith(number) and quoted in dpo.DPO_RULE and found["escapes"] == (escapes, 8)


def test_the_runs_refuse_another_prep_than_the_sweep_s(tmp_path):
    """No prep in --work-dir: exit, never build one; a prep whose weights differ from staleness_sweep/prep.json's:
    exit naming both; the sweep's own prep passes."""
    work, results = tmp_path / "work", tmp_path / "results"
    args = dpo.Args(results_dir=str(results), work_dir=str(work))
    run_args = sweep.paper_args(sweep.Args(algorithms=["dpo"], results_dir=str(results), work_dir=str(work)))
    with pytest.raises(SystemExit, match="no prep in"):
        dpo.sweep_prep(args, run_args)
    rm = dict(rm_pairs=5429, rm_test_pair_accuracy=0.869, rm_gold_correlation=0.474)
    flags = {name: getattr(run_args, name) for name in sweep.paper.PREP_FLAGS}
    work.mkdir()
    (work / "prep_paper.json").write_text(json.dumps(dict(flags=flags, **rm)))
    for part in ("sft", "rm"):
        (work / part).mkdir()
        (work / part / "model.safetensors").write_bytes(b"weights of " + part.encode())
    (results / sweep.SWEEP_NAME).mkdir(parents=True)
    recorded = dict(rm, prep_sha256=sweep.prep_fingerprint(work))
    (results / sweep.SWEEP_NAME / "prep.json").write_text(json.dumps(recorded))
    (results / sweep.SWEEP_NAME / "ppo__sync-1__lr0.0001__seed1.json").write_text(json.dumps(dict(rm_stats=rm)))
    assert dpo.sweep_prep(args, run_args)["prep_sha256"] == recorded["prep_sha256"]
    (work / "rm" / "model.safetensors").write_bytes(b"another machine's RM")
    with pytest.raises(SystemExit, match="is not the one of the 1 run in"):
        dpo.sweep_prep(args, run_args)
