"""scripts/mutation.py: the estimate for a sampled module (the arithmetic the committed scores rest on), and
which mutants a run selects."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("mutation_script", Path(__file__).parents[1] / "scripts" / "mutation.py")
mutation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation)

M = "structinit.init.impulse.x_f__mutmut_"


def test_wilson_interval_matches_the_textbook_values():
    lo, hi = mutation.wilson(90, 100)
    assert (lo, hi) == (pytest.approx(0.8256, abs=1e-4), pytest.approx(0.9448, abs=1e-4))
    assert mutation.wilson(10, 10)[1] == 1.0 and mutation.wilson(0, 10)[0] == 0.0


def test_estimate_counts_the_run_mutants_and_scales_the_sample_to_its_stratum():
    # 10 run outside the stratum: 8 killed, 1 survivor judged equivalent, 1 not. Stratum of 100,
    # 20 sampled: 15 killed, 1 equivalent, 4 survived; the 80 others not run.
    results = {f"{M}{i}": (1 if i < 8 else 0) for i in range(10)}
    stratum = [f"{M}{i}" for i in range(10, 110)]
    results.update({m: None for m in stratum})
    sample = stratum[:20]
    results.update({m: (1 if i < 15 else 0) for i, m in enumerate(sample)})
    eq = {f"{M}8": {}, sample[15]: {}}
    est = mutation.estimate(results, {"stratum": stratum, "sample": sample}, eq, slow={})
    share = 19 / 20  # the stratum's non-equivalent share
    assert est["score"] == pytest.approx((8 + 100 * share * 15 / 19) / (9 + 100 * share))
    lo, hi = mutation.wilson(15, 19)
    assert est["low"] == pytest.approx((8 + 100 * share * lo) / (9 + 100 * share))
    assert est["high"] == pytest.approx((8 + 100 * share * hi) / (9 + 100 * share))
    assert (est["sampled"], est["stratum"], est["sample_killed"], est["sample_equivalent"]) == (20, 100, 15, 1)
    # a slow test's kill counts as a kill
    assert mutation.estimate(results, {"stratum": stratum, "sample": sample}, eq,
                             slow={sample[16]: "t"})["sample_killed"] == 16


def test_no_estimate_while_mutants_outside_the_stratum_are_not_run():
    results = {f"{M}0": None, f"{M}1": 1, f"{M}2": 1}
    assert mutation.estimate(results, {"stratum": [f"{M}1", f"{M}2"], "sample": [f"{M}1"]}, {}, {}) is None
    results[f"{M}0"] = 1
    assert mutation.estimate(results, {"stratum": [f"{M}1", f"{M}2"], "sample": [f"{M}1"]}, {}, {})["score"] == 1.0


def test_survivors_with_a_sample_rerun_the_survivors_and_the_sample_not_every_mutant_not_run(tmp_path, monkeypatch):
    """``run --survivors --sample N``: what survived, and N of the mutants not run, drawn as
    ``--sample`` alone would draw them (``--survivors`` alone reruns every mutant not run)."""
    results = {f"{M}{i}": None for i in range(1, 41)}
    results.update({f"{M}41": 0, f"{M}42": 1, f"{M}43": 0})  # two survivors, one killed
    monkeypatch.setattr(mutation, "load_results", lambda: dict(results))
    monkeypatch.setattr(mutation, "EQUIVALENTS", tmp_path / "none.toml")
    monkeypatch.setattr(mutation, "LOGS", tmp_path)
    monkeypatch.setattr(mutation, "SAMPLES", tmp_path / "samples.json")
    monkeypatch.setattr(mutation, "PIDFILE", tmp_path / "run.pid")
    ran = []
    monkeypatch.setattr(mutation.subprocess, "call", lambda cmd, **kw: ran.append(cmd) or 0)

    def names(*argv):
        ran.clear()
        assert mutation.main(["run", "--wait", *argv]) == 0
        return set(ran[0][4:])

    both = names("--survivors", "--sample", "5", "init/impulse")
    sample = set(mutation.load_samples()["structinit.init.impulse"]["sample"])
    assert len(sample) == 5 and sample <= {f"{M}{i}" for i in range(1, 41)}
    assert both == sample | {f"{M}41", f"{M}43"}
    assert names("--survivors", "init/impulse") == {f"{M}{i}" for i in range(1, 42)} | {f"{M}43"}
    assert mutation.main(["run", "--wait", "--survivors", "--sample", "5"]) == 2  # a sample needs its modules
