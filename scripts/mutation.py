#!/usr/bin/env python
"""The mutation pass over structinit's core: run mutmut in the background, then summarize.

mutmut (configured under ``[tool.mutmut]`` in pyproject.toml) copies the package to ``mutants/``,
changes one function at a time in small ways (an operator, a constant, an argument, a string) and
runs the fast test tier's tests that reach that function. A mutant the tests notice is *killed*;
one they do not is a *survivor*: either a hole in the tests or a change no test could see (an
*equivalent* mutant). Survivors judged equivalent are kept, each with a one-line reason, in
``tests/mutation_equivalents.toml``; a judgement is matched by the function and the changed lines,
not by mutmut's mutant number (which shifts when the function changes), so reruns carry it.

Usage (from the repository root)::

    python scripts/mutation.py run structinit.solver.config structinit.solver.recipes   # in the background
    python scripts/mutation.py run --survivors structinit.solver.config   # rerun what survived there (not judged)
    python scripts/mutation.py status                                     # running? last progress line
    python scripts/mutation.py summary [--markdown] [--write-docs]        # per-module table
    python scripts/mutation.py survivors structinit.solver.config         # unjudged survivors with diffs
    python scripts/mutation.py judge MUTANT... --reason why no test can tell  # record an equivalent one
    python scripts/mutation.py run --sample 150 structinit.init.impulse   # a random sample of what is not run
    python scripts/mutation.py run --survivors --sample 150 structinit.init.impulse   # survivors + the sample
    python scripts/mutation.py save                                       # results -> tests/mutation_results.json

mutmut keeps its results in ``mutants/`` (not committed) and regenerates every mutant in a fresh
clone. ``save`` records them in ``tests/mutation_results.json``, keyed by function and the hash
mutmut gives the function's source; ``run`` and ``summary`` take a recorded result for a mutant
mutmut has none for while its function is unchanged, so a pass goes on where the last one, in
any clone, stopped. (A recorded kill assumes the tests that made it still exist.)

A module too large to run whole in one sitting can be *sampled*: ``--sample N`` draws N of its
mutants not yet run (the stratum), at random with a fixed seed, and records the draw in
``tests/mutation_samples.json``. Its score is then an estimate, the mutants already run counted as
they are and the stratum at the sample's kill rate, with a 95% Wilson interval from the sample;
the tables label it as such. Running the rest later turns the estimate back into a count.

One run at a time (a pid file in mutation-logs/ says which), one mutmut worker, one torch thread:
the pass is CPU-heavy and meant to run beside other work. Not part of CI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "mutation-logs"
PIDFILE = LOGS / "run.pid"
EQUIVALENTS = REPO / "tests" / "mutation_equivalents.toml"
DOCS = REPO / "docs" / "testing.md"
SLOW_RESULTS = REPO / "tests" / "mutation_slow_kills.json"  # committed, like the ledger
SAMPLES = REPO / "tests" / "mutation_samples.json"  # committed: the draws the estimates rest on
LEDGER = REPO / "tests" / "mutation_results.json"
DOCS_BEGIN, DOCS_END = "<!-- mutation-summary:begin -->", "<!-- mutation-summary:end -->"

#: mutmut's exit codes -> our categories. Timeouts and crashes (a mutant that loops or blows up
#: memory until the CPU limit kills it) are caught mutants; "no tests" means no fast-tier test
#: reaches the function at all.
KILLED = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          -9: "crash", -11: "crash", 37: "killed"}
SURVIVED = {0: "survived", 5: "no tests", 33: "no tests"}


def mutmut_bin() -> str:
    exe = Path(sys.executable).with_name("mutmut")
    return str(exe) if exe.exists() else "mutmut"


def module_of(mutant: str) -> str:
    """``structinit.solver.config.xǁSolveConfigǁkey__mutmut_3`` -> ``structinit.solver.config``."""
    return re.split(r"\.x[_ǁ]", mutant, maxsplit=1)[0]


def function_of(mutant: str) -> str:
    return mutant.partition("__mutmut_")[0]


def normalize_module(name: str) -> str:
    """``solver/config``, ``structinit/solver/config.py`` or ``structinit.solver.config`` -> dotted."""
    name = name.strip().removesuffix(".py").replace("/", ".")
    return name if name.startswith("structinit.") else "structinit." + name


# --------------------------------------------------------------------------- results

def load_metas() -> Dict[str, dict]:
    """module -> mutmut's record of it (``exit_code_by_key``, ``hash_by_function_name``, ...), from
    ``mutants/**/*.meta``."""
    out: Dict[str, dict] = {}
    for meta in sorted((REPO / "mutants").rglob("*.py.meta")):
        try:
            doc = json.loads(meta.read_text())
            doc["exit_code_by_key"]  # noqa: B018 - a file cut short mid-write lacks it
        except (ValueError, KeyError) as exc:  # a pass stopped while mutmut rewrote the file in place
            raise SystemExit(f"error: {meta.relative_to(REPO)} is unreadable ({exc}); a pass stopped while "
                             "mutmut wrote it? delete it (its module's results are lost), rerun the module") from None
        doc.setdefault("hash_by_function_name", {})
        out[".".join(meta.relative_to(REPO / "mutants").with_suffix("").with_suffix("").parts)] = doc
    return out


def load_ledger() -> dict:
    """The committed results (tests/mutation_results.json): ``{"functions": {function: {"hash",
    "measured", "results": {mutant number: exit code}}}}``, function as :func:`function_of` names it."""
    if not LEDGER.exists():
        return {"functions": {}}
    return json.loads(LEDGER.read_text())


def load_results() -> Dict[str, Optional[int]]:
    """Every mutant's mutmut exit code (``None``: not run yet), from ``mutants/**/*.meta``; a mutant
    mutmut has no result for takes the ledger's when its function's source is unchanged (same
    hash). mutmut regenerates every mutant in a fresh clone (its copies are older than the clone's
    files), so without the ledger each clone would start from nothing."""
    return merge_ledger(load_metas(), load_ledger())


def merge_ledger(metas: Dict[str, dict], ledger: dict) -> Dict[str, Optional[int]]:
    """mutmut's exit codes, with the ledger's filling the gaps of functions whose hash matches."""
    out: Dict[str, Optional[int]] = {}
    functions = ledger.get("functions", {})
    for doc in metas.values():
        hashes = dict(doc["hash_by_function_name"])
        for mutant, code in dict(doc["exit_code_by_key"]).items():
            if code is None:
                fn = function_of(mutant)
                rec = functions.get(fn)
                if rec is not None and rec["hash"] == hashes.get(fn.rpartition(".")[2]):
                    code = rec["results"].get(mutant.rpartition("__mutmut_")[2])
            out[mutant] = code
    return out


def save_ledger(metas: Dict[str, dict], ledger: dict, today: str, mutmut_version: str) -> Tuple[dict, int]:
    """The ledger with mutmut's results of ``metas`` written in: a function whose hash changed
    loses its old results; ``(ledger, mutants recorded)``."""
    functions = {fn: {**rec, "results": dict(rec["results"])} for fn, rec in ledger.get("functions", {}).items()}
    recorded = 0
    for doc in metas.values():
        hashes = dict(doc["hash_by_function_name"])
        for mutant, code in dict(doc["exit_code_by_key"]).items():
            if code is None:
                continue
            fn = function_of(mutant)
            digest = hashes.get(fn.rpartition(".")[2])
            if digest is None:
                continue
            rec = functions.get(fn)
            if rec is None or rec["hash"] != digest:
                rec = functions[fn] = {"hash": digest, "measured": today, "results": {}}
            number = mutant.rpartition("__mutmut_")[2]
            if rec["results"].get(number) != code:
                rec["results"][number], rec["measured"] = code, today
                recorded += 1
    return {"mutmut": mutmut_version, "functions": dict(sorted(functions.items()))}, recorded


def status(code: Optional[int]) -> str:
    if code is None:
        return "not run"
    return KILLED.get(code) or SURVIVED.get(code) or "suspicious"


def mutant_diff(mutant: str) -> str:
    """The unified diff of one mutant against the original function (mutmut's own rendering)."""
    os.chdir(REPO)
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    return get_diff_for_mutant(mutant, path=Path(*module_of(mutant).split(".")).with_suffix(".py"))


def change_of(diff: str) -> str:
    """The changed lines of a diff (``-old`` / ``+new``, whitespace-trimmed): what a judgement matches."""
    lines = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return "\n".join(line[0] + line[1:].strip() for line in lines)


def load_equivalents() -> Tuple[List[dict], Dict[str, str]]:
    """``(judgements, module notes)`` from tests/mutation_equivalents.toml."""
    import tomllib

    if not EQUIVALENTS.exists():
        return [], {}
    doc = tomllib.loads(EQUIVALENTS.read_text())
    notes = {normalize_module(m): v.get("note", "") for m, v in doc.get("modules", {}).items()}
    return doc.get("equivalent", []), notes


def load_slow_kills() -> Dict[str, str]:
    """Survivors of the fast tier that a slow test killed (``slow`` command): mutant -> killing tests.

    Like a judgement, a record holds only while the mutant's changed lines are the same."""
    if not SLOW_RESULTS.exists():
        return {}
    records = json.loads(SLOW_RESULTS.read_text())
    out = {}
    for m, r in records.items():
        if r.get("killed") and (REPO / "mutants").exists():
            try:
                if change_of(mutant_diff(m)) == r["change"]:
                    out[m] = r["tests"]
            except Exception:  # noqa: BLE001 - a mutant that no longer exists
                continue
    return out


def judged(survivors: Iterable[str], judgements: List[dict]) -> Dict[str, dict]:
    """Survivors matched to a judgement (same function, same changed lines; a TODO reason does not count)."""
    index: Dict[Tuple[str, str], dict] = {}
    for j in judgements:
        if j.get("reason", "").strip() and not j["reason"].startswith("TODO"):
            index[(j["function"], change_of(j["change"]))] = j
    out = {}
    functions = {f for f, _ in index}
    for m in survivors:
        if function_of(m) not in functions:
            continue
        j = index.get((function_of(m), change_of(mutant_diff(m))))
        if j is not None:
            out[m] = j
    return out


# --------------------------------------------------------------------------- commands

def running_pid() -> Optional[int]:
    if not PIDFILE.exists():
        return None
    try:
        pid = int(PIDFILE.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (ValueError, ProcessLookupError, PermissionError, IndexError):
        return None


def load_samples() -> Dict[str, dict]:
    """module -> ``{"stratum": [...], "sample": [...], "seed": int, "date": str}`` (samples.json)."""
    return json.loads(SAMPLES.read_text()) if SAMPLES.exists() else {}


def draw_sample(modules: List[str], n: int, seed: int) -> List[str]:
    """Grow each module's sample to ``n`` mutants and return the sampled ones without a result.

    The first draw fixes the module's stratum (its mutants not run at that time); later calls
    draw more only if ``n`` grew, from the stratum's mutants not drawn yet, so the sample stays
    uniform, and return whatever was drawn but not run (a run that was stopped goes on)."""
    import random

    results, samples, names = load_results(), load_samples(), []
    for mod in modules:
        rec = samples.get(mod)
        if rec is None:
            stratum = sorted(m for m, c in results.items() if module_of(m) == mod and c is None)
            rec = {"stratum": stratum, "sample": [], "seed": seed, "date": datetime.date.today().isoformat()}
        left = sorted(set(rec["stratum"]) - set(rec["sample"]) & set(results))
        more = max(0, n - len(rec["sample"]))
        rec["sample"] += random.Random(f"{rec['seed']}:{mod}:{len(rec['sample'])}").sample(left, min(more, len(left)))
        if rec["stratum"]:
            samples[mod] = rec
        names += [m for m in rec["sample"] if results.get(m, 0) is None]
    LOGS.mkdir(exist_ok=True)
    SAMPLES.write_text(json.dumps(samples, indent=1))
    return names


def wilson(k: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre, half = p + z * z / (2 * n), z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def cmd_run(args) -> int:
    pid = running_pid()
    if pid is not None:
        print(f"error: a mutation run is already going (pid {pid}); see `python scripts/mutation.py status`",
              file=sys.stderr)
        return 2
    modules = [normalize_module(m) for m in args.modules]
    if args.survivors:
        results = load_results()
        rerun = ("survived", "no tests", "suspicious") + (() if args.sample else ("not run",))
        names = sorted(m for m, c in results.items() if status(c) in rerun
                       and (not modules or module_of(m) in modules))
        judgements, _ = load_equivalents()
        eq = judged([m for m in names if status(results[m]) != "not run"], judgements)
        names = [m for m in names if m not in eq]  # a judged survivor would survive again; a judged one not run is run
        if args.functions:
            names = [m for m in names if function_of(m).rpartition(".")[2] in args.functions]
        if args.sample:  # the survivors, and the sample of what is not run (not all of it)
            if not modules:
                print("error: --sample needs the modules to sample", file=sys.stderr)
                return 2
            names = sorted(set(names) | set(draw_sample(modules, args.sample, args.seed)))
        if not names:
            print("nothing to rerun: every mutant of those modules is killed")
            return 0
    elif args.sample:
        if not modules:
            print("error: --sample needs the modules to sample", file=sys.stderr)
            return 2
        names = draw_sample(modules, args.sample, args.seed)
        if not names:
            print("nothing to run: every sampled mutant of those modules has a result")
            return 0
    else:
        results = load_results()
        known = {module_of(m) for m in results}
        if modules and all(mod in known for mod in modules):  # mutants exist: skip what has a result
            names = sorted(m for m, c in results.items() if module_of(m) in modules and c is None)
            if not names:
                print("nothing to run: every mutant of those modules has a result (mutants/ or the ledger)")
                return 0
        else:
            names = [m + ".*" for m in modules]
    LOGS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log = LOGS / f"run-{stamp}.log"
    cmd = [mutmut_bin(), "run", "--max-children", str(args.children), *names]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)  # mutmut puts mutants/ first on sys.path itself
    (LOGS / "last-command.txt").write_text(" ".join(cmd[:4] + (names if len(names) < 20 else
                                                                 [f"<{len(names)} mutants>"])) + "\n")
    if args.wait:
        return subprocess.call(cmd, cwd=REPO, env=env)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(["nohup", "nice", "-n", "10", *cmd], cwd=REPO, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    PIDFILE.write_text(f"{proc.pid} {log}\n")
    what = (f"{len(names)} surviving mutants" if args.survivors else f"a sample of {len(names)} mutants"
            if args.sample else ", ".join(modules) or "every configured module")
    print(f"started mutmut (pid {proc.pid}) on {what}; log {log.relative_to(REPO)}")
    return 0


def cmd_status(args) -> int:
    pid = running_pid()
    if PIDFILE.exists():
        parts = PIDFILE.read_text().split()
        log = Path(parts[1]) if len(parts) > 1 else None
        last = ""
        if log and log.exists():
            tail = log.read_bytes()[-4000:].decode("utf-8", "replace")
            progress = re.findall(r"(\d+/\d+\s+🎉[^⠀-⣿\n]*)", tail)
            last = progress[-1].strip() if progress else tail.strip().splitlines()[-1] if tail.strip() else ""
        print(f"{'running' if pid else 'finished'} (pid {parts[0]}), log {log}: {last}")
    else:
        print("no mutation run has been started here")
    return 0


def cmd_stop(args) -> int:
    pid = running_pid()
    if pid is None:
        print("no mutation run is going")
        return 0
    # mutmut saves every result as it comes, rewriting its .meta files in place, so a stop in the
    # middle of a write leaves one cut short: keep the last readable copy of each and put it back.
    readable = {}
    for meta in (REPO / "mutants").rglob("*.py.meta"):
        try:
            text = meta.read_text()
            json.loads(text)
            readable[meta] = text
        except ValueError:
            continue
    os.killpg(os.getpgid(pid), signal.SIGTERM)
    for _ in range(100):
        if running_pid() is None:
            break
        time.sleep(0.1)
    restored = []
    for meta, text in readable.items():
        try:
            json.loads(meta.read_text())
        except ValueError:
            meta.write_text(text)
            restored.append(meta.name)
    cut = f"; {', '.join(restored)} was cut short by the stop and is back as it was just before" if restored else ""
    print(f"stopped the run (pid {pid}); the mutant in flight stays 'not run'{cut}")
    return 0


def summarize(modules: Optional[List[str]] = None) -> Tuple[List[dict], Dict[str, dict], Dict[str, str]]:
    results = load_results()
    judgements, notes = load_equivalents()
    slow = load_slow_kills()
    by_module: Dict[str, Counter] = {}
    survivors: List[str] = []
    for name, code in results.items():
        mod = module_of(name)
        if modules and mod not in modules:
            continue
        s = status(code)
        if s in ("survived", "no tests", "suspicious") and name in slow:
            s = "killed slow"
        by_module.setdefault(mod, Counter())[s] += 1
        if s in ("survived", "no tests", "suspicious"):
            survivors.append(name)
    eq = judged(survivors, judgements)
    samples = load_samples()
    rows = []
    for mod in sorted(by_module):
        c = by_module[mod]
        n_eq = sum(1 for m in eq if module_of(m) == mod)
        total = sum(c.values())
        killed = c["killed"] + c["timeout"] + c["crash"] + c["killed slow"]
        live = c["survived"] + c["no tests"] + c["suspicious"]
        denom = total - n_eq - c["not run"]
        row = {"module": mod, "mutants": total, "killed": killed, "killed slow": c["killed slow"],
               "timeout/crash": c["timeout"] + c["crash"], "survived": live, "equivalent": n_eq,
               "unjudged": live - n_eq, "not run": c["not run"],
               "score": (killed / denom) if denom and not c["not run"] else None, "note": notes.get(mod, "")}
        if c["not run"] and mod in samples:
            row["estimate"] = estimate(results, samples[mod], eq, slow)
        rows.append(row)
    return rows, eq, notes


def estimate(results: Dict[str, Optional[int]], rec: dict, eq: Dict[str, dict], slow: Dict[str, str]) -> Optional[dict]:
    """A sampled module's score: the mutants outside the stratum as counted, the stratum's
    at the kill rate of its sample's mutants that have a result. ``None`` while those outside
    the stratum are not all run or no sampled mutant has a result."""
    stratum = set(rec["stratum"]) & set(results)
    mod = module_of(next(iter(stratum))) if stratum else None
    outside = [m for m in results if module_of(m) == mod and m not in stratum]
    ran = [m for m in rec["sample"] if m in stratum and results[m] is not None]
    if not stratum or not ran or any(results[m] is None for m in outside):
        return None

    def caught(m):
        return status(results[m]) in ("killed", "timeout", "crash") or m in slow

    k_out = sum(map(caught, outside))
    n_out = len(outside) - sum(1 for m in outside if m in eq)
    k_s, e_s, n_s = sum(map(caught, ran)), sum(1 for m in ran if m in eq), len(ran)
    if n_s == e_s:
        return None
    share, u = (n_s - e_s) / n_s, len(stratum)  # the stratum's non-equivalent share, its size

    def score(p):
        return (k_out + u * share * p) / (n_out + u * share)

    lo, hi = wilson(k_s, n_s - e_s)
    return {"score": score(k_s / (n_s - e_s)), "low": score(lo), "high": score(hi), "sampled": n_s,
            "stratum": u, "sample_killed": k_s, "sample_equivalent": e_s}


HEAD = ["module", "mutants", "killed", "killed slow", "survived", "equivalent", "unjudged", "not run", "score"]


def table(rows: List[dict], markdown: bool, measured: str = "",
          kept: Optional[Dict[str, List[str]]] = None) -> str:
    """The per-module table; in markdown with a ``measured`` date column (the date ``measured``)
    and, for a module none of whose mutants has a result now, the row ``kept[module]`` from the
    table already in the docs (so a pass over some modules does not wipe the others' scores)."""
    head = list(HEAD)
    def cell(r, k):
        if k == "score" and r[k] is None and r.get("estimate"):
            e = r["estimate"]
            return (f"≈{100 * e['score']:.1f}% ({100 * e['low']:.0f}-{100 * e['high']:.0f}%, estimated from "
                    f"{e['sampled']} sampled of {e['stratum']} not run)")
        if k == "score":
            return "-" if r[k] is None else f"{100 * r[k]:.1f}% ({r['killed']}/{r['mutants'] - r['equivalent']})"
        return str(r[k])
    body = []
    for r in rows:
        if markdown and kept and r["module"] in kept and r["not run"] == r["mutants"] and not r.get("estimate"):
            body.append(kept[r["module"]][:-1] + [r["note"] or kept[r["module"]][-1]])  # today's note, if any
            continue
        cells = [cell(r, k) for k in head]
        body.append(cells[:1] + [measured] + cells[1:] + [r["note"]] if markdown
                    else cells)
    if markdown:
        head = head[:1] + ["measured"] + head[1:] + ["note"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def rows_in_docs(doc: str) -> Dict[str, List[str]]:
    """The rows of the table between the markers in docs/testing.md, by module, as cells in the
    current column order (a row of the older table without a ``measured`` column gets the date
    its block says it was measured)."""
    if DOCS_BEGIN not in doc:
        return {}
    block = doc[doc.index(DOCS_BEGIN):doc.index(DOCS_END)]
    date = re.search(r"Measured (\d{4}-\d{2}-\d{2})", block)
    out = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not cells or not cells[0].startswith("structinit."):
            continue
        if len(cells) == len(HEAD) + 1:  # no measured column
            cells = cells[:1] + [date.group(1) if date else ""] + cells[1:]
        out[cells[0]] = cells
    return out


def cmd_summary(args) -> int:
    modules = [normalize_module(m) for m in args.modules] or None
    rows, eq, _ = summarize(modules)
    if args.json:
        print(json.dumps({"modules": rows, "equivalent": {m: j["reason"] for m, j in sorted(eq.items())}}, indent=2))
        return 0
    doc = DOCS.read_text() if DOCS.exists() else ""
    kept = rows_in_docs(doc)
    text = table(rows, args.markdown or args.write_docs, datetime.date.today().isoformat(), kept)
    if args.write_docs:
        block = (f"{DOCS_BEGIN}\nWith `python scripts/mutation.py run MODULE...` (mutmut {_mutmut_version()}, the "
                 "fast tier), summarized by `python scripts/mutation.py summary --write-docs`, which rewrites the "
                 "rows of the modules that have results now and keeps the others as they were measured. Score: "
                 f"killed / (mutants - equivalent).\n\n{text}\n{DOCS_END}")
        if DOCS_BEGIN in doc:
            doc = doc[:doc.index(DOCS_BEGIN)] + block + doc[doc.index(DOCS_END) + len(DOCS_END):]
        else:
            doc = doc.rstrip() + "\n\n" + block + "\n"
        DOCS.write_text(doc)
        print(f"updated {DOCS.relative_to(REPO)}")
    print(text)
    if args.reasons:
        print("\nequivalent survivors:")
        for m, j in sorted(eq.items()):
            print(f"  {m}: {j['reason']}")
    return 0


def ledger_text(ledger: dict) -> str:
    """The ledger as JSON with one line per function (diffs then show which functions changed)."""
    rows = [f" {json.dumps(fn)}: {json.dumps(rec)}" for fn, rec in ledger["functions"].items()]
    return (f'{{"mutmut": {json.dumps(ledger["mutmut"])}, "functions": {{\n' + ",\n".join(rows) + "\n}}\n")


def cmd_save(args) -> int:
    """Write mutmut's results into the committed ledger (tests/mutation_results.json)."""
    metas = load_metas()
    if not metas:
        print("error: no mutants/ here: run a pass first", file=sys.stderr)
        return 2
    ledger, recorded = save_ledger(metas, load_ledger(), datetime.date.today().isoformat(), _mutmut_version())
    tmp = LEDGER.with_suffix(".json.tmp")
    tmp.write_text(ledger_text(ledger))
    os.replace(tmp, LEDGER)
    total = sum(len(r["results"]) for r in ledger["functions"].values())
    print(f"{LEDGER.relative_to(REPO)}: {recorded} result(s) new or changed, {total} in all")
    return 0


def _mutmut_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


def cmd_survivors(args) -> int:
    modules = [normalize_module(m) for m in args.modules] or None
    results = load_results()
    judgements, _ = load_equivalents()
    live = sorted((m for m, c in results.items() if status(c) in ("survived", "no tests", "suspicious")
                   and (modules is None or module_of(m) in modules)),
                  key=lambda m: (function_of(m), int(m.rpartition("_")[2])))
    eq = judged(live, judgements)
    for m in live:
        if m in eq and not args.all:
            continue
        diff = mutant_diff(m)
        if args.toml:
            change = change_of(diff)
            print(f'[[equivalent]]\nmutant = "{m}"\nfunction = "{function_of(m)}"\n'
                  f'change = {toml_text(change)}\nreason = "TODO"\n')
        else:
            print(f"# {m}: {status(results[m])}" + (f"  (equivalent: {eq[m]['reason']})" if m in eq else ""))
            print("\n".join(diff.splitlines()[2:]))
            print()
    return 0


def toml_text(text: str) -> str:
    """``text`` as a TOML multi-line basic string (backslashes and quotes escaped: a diff may hold
    a regex or a docstring)."""
    return '"""\n' + text.replace("\\", "\\\\").replace('"', '\\"') + '\n"""'


def cmd_judge(args) -> int:
    """Append a judgement (this survivor is equivalent, because REASON) to the equivalents file."""
    reason = " ".join(args.reason).strip()
    if not reason or '"' in reason or "\n" in reason:
        print("error: give a one-line reason without double quotes", file=sys.stderr)
        return 2
    results = load_results()
    entries = []
    for m in args.mutants:
        if status(results.get(m)) not in ("survived", "no tests", "suspicious"):
            print(f"error: {m} is not a survivor ({status(results.get(m))})", file=sys.stderr)
            return 2
        change = change_of(mutant_diff(m))
        entries.append(f'\n[[equivalent]]\nmutant = "{m}"\nfunction = "{function_of(m)}"\n'
                       f'change = {toml_text(change)}\nreason = "{reason}"\n')
    with open(EQUIVALENTS, "a") as fh:
        fh.write("".join(entries))
    print(f"judged {len(entries)} mutant(s) equivalent in {EQUIVALENTS.relative_to(REPO)}")
    return 0


def run_slow_tests(tests: List[str], cwd: Path, env: Dict[str, str], timeout: Optional[float]):
    """``(pytest's exit code or "timeout", its output)``. Past ``timeout`` seconds the tests and
    every process they started are killed: a mutant that hangs them (a deadlock between torchrun's
    processes, say) counts as caught, as mutmut counts its own timeouts."""
    mark = uuid.uuid4().hex  # every process the tests start inherits it, torchrun's own sessions included
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--rootdir=.",
                             *tests], cwd=cwd, env=dict(env, MUTATION_SLOW_RUN=mark), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_marked(f"MUTATION_SLOW_RUN={mark}".encode())
        out, _ = proc.communicate()
        return "timeout", out


def kill_marked(entry: bytes) -> None:
    """SIGKILL every process whose environment holds ``entry`` (Linux /proc): torchrun starts its
    workers in sessions of their own, beyond the reach of the tests' process group."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry in environ.read_bytes().split(b"\0"):
                os.kill(int(environ.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def cmd_slow(args) -> int:
    """Run the fast tier's unjudged survivors against slow tests (each mutant in turn, in the
    foreground): tests that spawn processes see the mutant too (PYTHONPATH and MUTANT_UNDER_TEST
    are inherited)."""
    modules = [normalize_module(m) for m in args.modules] or None
    results = load_results()
    judgements, _ = load_equivalents()
    live = sorted(m for m, c in results.items() if status(c) in ("survived", "no tests", "suspicious")
                  and (modules is None or module_of(m) in modules))
    if args.functions:
        live = [m for m in live if function_of(m).rpartition(".")[2] in args.functions]
    if args.mutants:
        live = [m for m in live if m in set(args.mutants)]
    eq = judged(live, judgements)
    records = json.loads(SLOW_RESULTS.read_text()) if SLOW_RESULTS.exists() else {}
    todo = [m for m in live if m not in eq and not (m in records and records[m]["change"] == change_of(mutant_diff(m)))]
    LOGS.mkdir(exist_ok=True)
    mutants_dir = REPO / "mutants"
    # mutmut copies tests/ at the start of each pass; a test written since must be there too
    shutil.copytree(REPO / "tests", mutants_dir / "tests", dirs_exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(mutants_dir))
    print(f"{len(todo)} survivors to run against: {' '.join(args.tests)}")
    for i, m in enumerate(todo, 1):
        env["MUTANT_UNDER_TEST"] = m
        code, out = run_slow_tests(args.tests, mutants_dir, env, args.timeout)
        killed = code in (1, "timeout")
        if not killed and code != 0:
            print(f"  {m}: pytest exit {code} (not counted)\n{out[-800:]}")
            continue
        records[m] = {"change": change_of(mutant_diff(m)), "killed": killed, "tests": " ".join(args.tests)}
        if code == "timeout":
            records[m]["timeout"] = args.timeout
        SLOW_RESULTS.write_text(json.dumps(records, indent=1, sort_keys=True))
        print(f"[{i}/{len(todo)}] {'killed  ' if killed else 'survived'} {m}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start mutmut in the background on MODULEs (default: all configured)")
    r.add_argument("modules", nargs="*")
    r.add_argument("--survivors", action="store_true",
                   help="rerun only mutants not yet killed (nor judged); with --sample, the survivors and the "
                        "sample, not every mutant not run")
    r.add_argument("--functions", nargs="*", help="with --survivors: only mutants of these functions (e.g. x_lr_at)")
    r.add_argument("--sample", type=int, metavar="N",
                   help="grow each module's random sample of mutants not run to N and run what it has not run "
                        "(an estimated score)")
    r.add_argument("--seed", type=int, default=0, help="with --sample: the first draw's seed (default 0)")
    r.add_argument("--children", type=int, default=1, help="parallel mutmut workers (default 1)")
    r.add_argument("--wait", action="store_true", help="run in the foreground")
    r.set_defaults(fn=cmd_run)
    sub.add_parser("status", help="is a run going, and its last progress line").set_defaults(fn=cmd_status)
    sub.add_parser("stop", help="stop the run (results so far are kept)").set_defaults(fn=cmd_stop)
    s = sub.add_parser("summary", help="per-module mutants, killed, survived, equivalent, score")
    s.add_argument("modules", nargs="*")
    s.add_argument("--markdown", action="store_true")
    s.add_argument("--json", action="store_true")
    s.add_argument("--reasons", action="store_true", help="also list the equivalent survivors with their reason")
    s.add_argument("--write-docs", action="store_true", help="replace the summary block in docs/testing.md")
    s.set_defaults(fn=cmd_summary)
    sub.add_parser("save", help="record mutmut's results in tests/mutation_results.json (committed; a fresh "
                                "clone's run and summary reuse those of unchanged functions)").set_defaults(fn=cmd_save)
    v = sub.add_parser("survivors", help="surviving mutants not judged equivalent, with their diffs")
    v.add_argument("modules", nargs="*")
    v.add_argument("--toml", action="store_true", help="print them as stubs for tests/mutation_equivalents.toml")
    v.add_argument("--all", action="store_true", help="include the ones judged equivalent")
    v.set_defaults(fn=cmd_survivors)
    j = sub.add_parser("judge", help="record survivors as equivalent, with a one-line reason")
    j.add_argument("mutants", nargs="+")
    j.add_argument("--reason", nargs="+", required=True)
    j.set_defaults(fn=cmd_judge)
    w = sub.add_parser("slow", help="run the fast tier's survivors against slow tests (foreground)")
    w.add_argument("modules", nargs="*")
    w.add_argument("--tests", nargs="+", required=True, help="pytest node ids, relative to the repository")
    w.add_argument("--functions", nargs="*", help="only mutants of these functions (e.g. x_train)")
    w.add_argument("--mutants", nargs="*", help="only these mutants (full names, as `survivors` prints them)")
    w.add_argument("--timeout", type=float, help="seconds before a mutant's tests are killed and it counts as "
                                                 "caught (a hang); give several times the tests' own time")
    w.set_defaults(fn=cmd_slow)
    args = p.parse_args(argv)
    os.chdir(REPO)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
