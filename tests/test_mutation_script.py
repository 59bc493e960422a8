"""scripts/mutation.py: the estimate for a sampled module (the arithmetic the committed scores rest on), and
which mutants a run selects."""

import importlib.util
import json
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


def _metas(codes, hashes):
    """mutmut's record of structinit.init.impulse: ``codes`` {function: [exit codes of mutants 1..]}."""
    return {"structinit.init.impulse": {
        "exit_code_by_key": {f"structinit.init.impulse.{fn}__mutmut_{i}": c
                             for fn, cs in codes.items() for i, c in enumerate(cs, 1)},
        "hash_by_function_name": hashes}}


def test_the_ledger_keeps_results_across_clones_while_the_function_is_unchanged():
    """``save`` records mutmut's results keyed by function and source hash; a fresh clone's mutants
    (all not run) take them back for unchanged functions only, and a changed function's old results
    are dropped when it is saved again."""
    ran = _metas({"x_f": [1, 0, None], "x_g": [1, 1]}, {"x_f": "aaa", "x_g": "bbb"})
    ledger, recorded = mutation.save_ledger(ran, {"functions": {}}, "2026-11-26", "3.8.1")
    assert recorded == 4  # f's third was not run: nothing to record
    f, g = ledger["functions"]["structinit.init.impulse.x_f"], ledger["functions"]["structinit.init.impulse.x_g"]
    assert (f["hash"], f["results"], f["measured"]) == ("aaa", {"1": 1, "2": 0}, "2026-11-26")
    assert g["results"] == {"1": 1, "2": 1}
    # a fresh clone: mutmut regenerated everything; g changed since (another hash)
    fresh = _metas({"x_f": [None] * 3, "x_g": [None] * 2}, {"x_f": "aaa", "x_g": "ccc"})
    merged = mutation.merge_ledger(fresh, ledger)
    p = "structinit.init.impulse."
    assert merged == {p + "x_f__mutmut_1": 1, p + "x_f__mutmut_2": 0, p + "x_f__mutmut_3": None,
                      p + "x_g__mutmut_1": None, p + "x_g__mutmut_2": None}
    # mutmut's own result wins over the ledger's
    assert mutation.merge_ledger(_metas({"x_f": [0, 1, 1], "x_g": [1, 1]}, {"x_f": "aaa", "x_g": "ccc"}),
                                 ledger)[p + "x_f__mutmut_1"] == 0
    # saving g's new results replaces its old ones; f's stay
    again, recorded = mutation.save_ledger(_metas({"x_f": [None] * 3, "x_g": [0, None]},
                                                  {"x_f": "aaa", "x_g": "ccc"}), ledger, "2026-11-27", "3.8.1")
    assert recorded == 1
    assert again["functions"][p + "x_g"] == {"hash": "ccc", "measured": "2026-11-27", "results": {"1": 0}}
    assert again["functions"][p + "x_f"] == f
    assert json.loads(mutation.ledger_text(again)) == again and again["mutmut"] == "3.8.1"


def test_a_full_run_skips_what_the_ledger_or_mutmut_already_has(tmp_path, monkeypatch):
    results = {f"{M}1": 1, f"{M}2": None, f"{M}3": 0, f"{M}4": None}
    monkeypatch.setattr(mutation, "load_results", lambda: dict(results))
    monkeypatch.setattr(mutation, "LOGS", tmp_path)
    monkeypatch.setattr(mutation, "PIDFILE", tmp_path / "run.pid")
    ran = []
    monkeypatch.setattr(mutation.subprocess, "call", lambda cmd, **kw: ran.append(cmd) or 0)
    assert mutation.main(["run", "--wait", "init/impulse"]) == 0
    assert ran[0][4:] == [f"{M}2", f"{M}4"]
    # a module mutmut has not generated yet is run whole
    assert mutation.main(["run", "--wait", "init/mimetic"]) == 0
    assert ran[1][4:] == ["structinit.init.mimetic.*"]
    results.update({f"{M}2": 1, f"{M}4": 1})
    assert mutation.main(["run", "--wait", "init/impulse"]) == 0 and len(ran) == 2  # nothing left to run


@pytest.mark.slow
def test_slow_tests_that_hang_past_the_timeout_are_killed_with_their_children(tmp_path):
    """A mutant that hangs the slow tests counts as caught once the timeout passes, and nothing it
    started is left running, not even a process in a session of its own (torchrun's workers)."""
    import os
    import time

    pidfile = tmp_path / "child.pid"
    (tmp_path / "test_hang.py").write_text(
        "import subprocess, sys, time\n"
        "def test_hang():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                             start_new_session=True)  # as torchrun starts its workers\n"
        f"    open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(600)\n"
        "def test_quick():\n"
        "    assert 1 + 1 == 3\n")
    env = dict(os.environ)
    t0 = time.monotonic()
    code, out = mutation.run_slow_tests(["test_hang.py::test_hang"], tmp_path, env, timeout=5)
    assert code == "timeout" and time.monotonic() - t0 < 60
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the hanging test's child survived the timeout")
    code, out = mutation.run_slow_tests(["test_hang.py::test_quick"], tmp_path, env, timeout=60)
    assert code == 1 and "assert 1 + 1 == 3" in out
