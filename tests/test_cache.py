"""The artifact cache: where it is, how a key, a file name or a path finds an artifact, what
happens to corrupt copies (the user's are removed, the shipped ones skipped), the per-key lock,
and solve() refusing what it cannot do before it solves."""

import os
import shutil
from pathlib import Path

import pytest
from conftest import says

from structinit.errors import StructinitError, UsageError
from structinit.solver import cache as cache_mod
from structinit.solver.artifact import read_artifact
from structinit.solver.cache import (
    check_cache_dir,
    find_cached,
    key_lock,
    list_artifacts,
    resolve_artifact,
    resolve_key,
    search_dirs,
    shipped_cache_dir,
    user_cache_dir,
)
from structinit.solver.config import SolveConfig
from structinit.solver.run import solve

CFG = SolveConfig(grid=(4, 4), dim=16, heads=2)


def rendered(fn, *args, **kwargs):
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return exc.value.render(lambda n: f"<{n}>")


def test_user_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.delenv("STRUCTINIT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "structinit"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty means unset
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "structinit"
    monkeypatch.setenv("STRUCTINIT_CACHE", "~/mine")
    assert user_cache_dir() == tmp_path / "home" / "mine"
    assert user_cache_dir("~/flag") == tmp_path / "home" / "flag"
    assert search_dirs("~/flag") == [tmp_path / "home" / "flag", shipped_cache_dir()]
    assert shipped_cache_dir() == Path(cache_mod.__file__).parents[1] / "data" / "cache"


def test_an_install_without_shipped_artifacts_searches_the_user_cache_only(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "shipped_cache_dir", lambda: None)
    assert search_dirs(tmp_path) == [tmp_path]
    assert list(list_artifacts(tmp_path)) == [] and find_cached(CFG.filename, tmp_path) is None


def test_check_cache_dir(tmp_path):
    check_cache_dir(None)
    check_cache_dir(tmp_path / "missing")  # created when written
    check_cache_dir(tmp_path)
    (tmp_path / "f").write_text("x")
    assert says(rendered(check_cache_dir, tmp_path / "f"), f"<cache_dir> {tmp_path / 'f'}", "not a folder")


def test_an_explicit_cache_dir_is_searched_and_listed(tmp_path, cache_dir):
    own = tmp_path / "own"
    art = solve(CFG, cache_dir=own).artifact
    (own / f".{CFG.filename}.123.abcd.tmp").write_bytes(b"partial")
    (own / ".hidden.safetensors").write_bytes(b"partial")
    listed = list(list_artifacts(own))
    assert art.path in listed and all(not p.name.startswith(".") for p in listed)
    assert art.path not in list(list_artifacts())  # the default cache (the environment's) does not hold it
    for name in (CFG.key, CFG.filename, art.path.stem):
        assert resolve_key(name, own) == art.path, name
        assert resolve_artifact(name, own).key == CFG.key
    assert resolve_key(CFG.key) is None and resolve_key(CFG.key[:6], own) is None
    assert resolve_key("d16-h2-f3-" + CFG.key, own) == art.path  # a tail of the name ending in the key
    assert resolve_artifact(art) is art and resolve_artifact(str(art.path)).path == art.path
    assert says(rendered(resolve_artifact, "nothing", own), "<artifact> nothing", "no such file", "no cached artifact",
                "structinit inspect")
    assert find_cached(CFG.filename, own).key == CFG.key and find_cached(CFG.filename) is None


def test_corrupt_user_copy_is_removed_and_a_corrupt_shipped_copy_skipped(tmp_path, monkeypatch):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    art = solve(CFG, cache_dir=user).artifact
    shipped.mkdir()
    shutil.copy(art.path, shipped / CFG.filename)
    monkeypatch.setattr(cache_mod, "shipped_cache_dir", lambda: shipped)
    art.path.write_bytes(b"garbage")
    warnings = []
    found = find_cached(CFG.filename, user, warn=warnings.append)
    assert found.path == shipped / CFG.filename and not art.path.exists()  # removed, then found in the next folder
    assert len(warnings) == 1 and warnings[0].startswith("ignoring corrupt artifact: ") and "recomputed" in warnings[0]
    (shipped / CFG.filename).write_bytes(b"garbage too")
    assert find_cached(CFG.filename, user, warn=warnings.append) is None
    assert (shipped / CFG.filename).exists() and len(warnings) == 2  # shipped copies are only ever read
    assert find_cached(CFG.filename, user) is None  # no warn callback: silent
    res = solve(CFG, cache_dir=user)
    assert not res.cached and read_artifact(user / CFG.filename).key == CFG.key


def test_key_lock_times_out_with_a_way_out(tmp_path):
    from filelock import FileLock, Timeout

    held = FileLock(str(tmp_path / ".locks" / "x.safetensors.lock"))
    (tmp_path / ".locks").mkdir()
    held.acquire()
    try:
        with pytest.raises(StructinitError) as exc:
            with key_lock(tmp_path, "x.safetensors", timeout=0.2):
                pass
    finally:
        held.release()
    assert says(str(exc.value), "waited 0 s", "another process", f"x.safetensors in {tmp_path}",
                f"remove {tmp_path / '.locks' / 'x.safetensors.lock'}")
    entered = []
    with key_lock(tmp_path, "x.safetensors", timeout=0.2):
        entered.append(True)
        again = FileLock(str(tmp_path / ".locks" / "x.safetensors.lock"), timeout=0.05)
        with pytest.raises(Timeout):  # held while inside
            again.acquire()
    assert entered and FileLock(str(tmp_path / ".locks" / "x.safetensors.lock"), timeout=0.05).acquire()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StructinitError, match=f"cannot lock the cache folder {tmp_path / 'file'}: "):
        with key_lock(tmp_path / "file", "y.safetensors"):
            pass


def test_solve_refuses_before_solving(tmp_path):
    assert "threads" in rendered(solve, CFG, threads=0)
    assert "unknown <device> 'tpu'" in rendered(solve, CFG, device="tpu")
    (tmp_path / "f").write_text("x")
    assert says(rendered(solve, CFG, cache_dir=tmp_path / "f"), f"<cache_dir> {tmp_path / 'f'}", "not a folder")
    with pytest.raises(StructinitError) as exc:  # found out only when creating it: exit 1, not a usage error
        solve(CFG, cache_dir=tmp_path / "f" / "sub")
    assert says(exc.value.render(lambda n: f"<{n}>"), "cannot create", f"<cache_dir> folder {tmp_path / 'f' / 'sub'}",
                "Not a directory")
    assert not any(p.suffix == ".safetensors" for p in tmp_path.rglob("*"))


def test_solve_uses_the_cache_and_force_replaces_it(tmp_path):
    first = solve(CFG, cache_dir=tmp_path)
    assert not first.cached and first.artifact.path == tmp_path / CFG.filename
    os.utime(first.artifact.path, (1, 1))
    hit = solve(CFG, cache_dir=tmp_path)
    assert hit.cached and hit.artifact.path.stat().st_mtime == 1
    forced = solve(CFG, cache_dir=tmp_path, force=True)
    assert not forced.cached and forced.artifact.path.stat().st_mtime > 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", CFG.filename]
    progress = []
    solve(SolveConfig(grid=(4, 4), dim=16, heads=2, recipe="paper", params={"iters": 200}), cache_dir=tmp_path,
          progress=lambda done, total: progress.append((done, total)))
    assert progress == [(100, 200), (200, 200)]


def test_bad_threads_and_devices_are_refused_even_when_the_cache_has_the_result(tmp_path):
    solve(CFG, cache_dir=tmp_path)
    assert "threads" in rendered(solve, CFG, cache_dir=tmp_path, threads=0)
    assert "unknown <device> 'tpu'" in rendered(solve, CFG, cache_dir=tmp_path, device="tpu")


def test_a_solve_runs_on_the_torch_threads_it_is_given(tmp_path, one_torch_thread):
    import torch

    torch.set_num_threads(2)
    assert not solve(CFG, cache_dir=tmp_path, threads=1).cached
    assert torch.get_num_threads() == 1


def test_a_cache_folder_is_created_with_its_parents(tmp_path):
    res = solve(CFG, cache_dir=tmp_path / "a" / "b")
    assert res.artifact.path == tmp_path / "a" / "b" / CFG.filename and read_artifact(res.artifact.path).key == CFG.key


def test_a_cache_hit_waits_for_no_lock_and_imports_no_torch(tmp_path):
    """The lock-free first look: a hit returns while another process holds the key's lock (and
    reads the artifact without torch, whose import alone takes a second or two)."""
    import subprocess
    import sys

    from filelock import FileLock

    solve(CFG, cache_dir=tmp_path)
    script = ("import sys; from structinit.solver.run import solve; from structinit.solver.config import SolveConfig; "
              f"r = solve(SolveConfig(grid=(4, 4), dim=16, heads=2), cache_dir={str(tmp_path)!r}); "
              "print(r.cached, r.artifact.path.name, 'torch' in sys.modules)")
    with FileLock(str(tmp_path / ".locks" / (CFG.filename + ".lock"))):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert r.stdout.split() == ["True", CFG.filename, "False"], r.stderr[-2000:]


@pytest.mark.parametrize("left", ["artifact", "corrupt"])
def test_a_solver_that_waited_for_the_lock_takes_what_the_holder_left(tmp_path, left):
    """Between the first look and the lock, another process may finish the key: the waiter then
    returns that artifact; a corrupt copy is reported, removed and solved again."""
    import threading

    from filelock import FileLock

    from structinit.solver.artifact import write_artifact
    from structinit.solver.run import compute

    warnings, said, out = [], [], {}
    holder = FileLock(str(tmp_path / ".locks" / (CFG.filename + ".lock")))
    (tmp_path / ".locks").mkdir()
    holder.acquire()
    waiter = threading.Thread(target=lambda: out.update(res=solve(CFG, cache_dir=tmp_path, warn=warnings.append,
                                                                  log=said.append)))
    waiter.start()
    while not said and waiter.is_alive():  # it says it waits once it has looked and found the lock held
        waiter.join(0.01)
    assert said[0].startswith(f"waiting for another process solving {CFG.filename}")  # past the first look
    target = tmp_path / CFG.filename
    if left == "artifact":
        theirs = compute(CFG)
        theirs.stats["seconds"] = -1.0  # tells their copy from one the waiter would solve
        write_artifact(theirs, target)
    else:
        target.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    holder.release()
    waiter.join(60)
    assert not waiter.is_alive()
    res = out["res"]
    if left == "artifact":
        assert res.cached and res.artifact.stats["seconds"] == -1.0 and warnings == []
    else:
        assert not res.cached and read_artifact(target).key == CFG.key
        assert len(warnings) == 1 and warnings[0].startswith(f"ignoring corrupt artifact: {target}")


def test_a_failed_write_of_a_solved_artifact_says_why_and_stores_nothing(tmp_path):
    """Past a file-size limit (the kernel's stand-in for a full disk) the write fails with the
    system's reason; no artifact or temp file is left."""
    import resource

    big = SolveConfig(grid=(8, 8), dim=128, heads=4, layers=3)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(StructinitError) as exc:
            solve(big, cache_dir=tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert says(exc.value.render(lambda n: f"<{n}>"), "cannot write the artifact", f"<cache_dir> {tmp_path}",
                "File too large", "nothing was stored")
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == []
