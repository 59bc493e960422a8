"""Hostile and unusual input, as a new user or a hostile tester would give it: every bad case is one
``error:`` line and an exit code (never a traceback), changes none of the user's files and leaves
no partial output; the cases that used to be silently wrong are now right or refused.

Full and read-only disks are real: small tmpfs mounts (the tests run as root in CI), with
``RLIMIT_FSIZE`` in a subprocess as the full-disk fallback where mounting is not allowed.
"""

import contextlib
import hashlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import error_line
from grids import DIGITS, variant

from structinit.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
DIM, HEADS = 64, 4
SHIPPED_KEY = "6095a9c75beb"  # n64-d64-h4-f3, 4 layers, shipped in structinit/data/cache


# --------------------------------------------------------------------------- helpers

def files(folder: Path) -> dict:
    """Every file under ``folder`` (hidden ones too) -> SHA-256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def one_error(r, code=2, *needles):
    """``r`` failed with exit ``code``: one ``error:`` line on stderr, last (progress lines may come
    first on a loaded machine: :func:`conftest.error_line`), no Python warning, nothing on stdout."""
    assert r.returncode == code, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    line = error_line(r.stderr)
    assert "Warning" not in r.stderr and r.stdout == ""
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def timm_vit(class_token=False, img_size=16, depth=2, learned=False, seed=0):
    import timm

    from structinit.init.pos_embed import set_sincos_pos_embed

    torch.manual_seed(seed)
    m = timm.create_model("vit_tiny_patch16_224", img_size=img_size, patch_size=2, embed_dim=DIM, depth=depth,
                          num_heads=HEADS, class_token=class_token, global_pool="token" if class_token else "avg",
                          num_classes=10)
    if not learned:
        set_sincos_pos_embed(m, zero_prefix=True)
    return m


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Checkpoints built once: a training-style timm checkpoint, a bare state dict, a ViT with a class
    token and a learned position embedding, one on a 14x12 grid, and a pickle that asks to run code."""
    d = tmp_path_factory.mktemp("made")
    torch.save({"state_dict": timm_vit().state_dict(), "epoch": 3, "arch": "vit_tiny_patch16_224"}, d / "vit.pth")
    torch.save(timm_vit().state_dict(), d / "plain.pt")
    torch.save(timm_vit(class_token=True, learned=True).state_dict(), d / "learned.pth")
    torch.save(timm_vit(class_token=True, img_size=(28, 24), learned=True).state_dict(), d / "rect.pth")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {d / 'pwned'}",))

    torch.save({"state_dict": {"x": torch.zeros(1)}, "payload": Evil()}, d / "evil.pth")
    return d


#: The noise fit of the tests that read plain.pt's fit from the module's cache (``fitted``): 16 inputs
#: and 20 steps, not 256 and 300 (they are about files and messages; the fit is tested in
#: test_data_fit and test_apply_data).
QUICK_FIT = ["-p", "data_fit_samples=16", "-p", "data_fit=20"]


@pytest.fixture(scope="module")
def plain_fit(made, tmp_path_factory):
    """A user cache with what ``apply plain.pt --heads 4`` solves and fits (the solve for its two
    layers and the noise fit of its weights), made once for the module."""
    from conftest import run_cli

    cache = tmp_path_factory.mktemp("plain-fit") / "cache"
    r = run_cli("apply", made / "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", cache.parent / "o.pt",
                env={"STRUCTINIT_CACHE": cache})
    assert r.returncode == 0 and len(list(cache.glob("*-fit-*.safetensors"))) == 1, r.stderr
    return cache


@pytest.fixture
def fitted(plain_fit, cache_dir):
    """This test's user cache starts with plain.pt's solve and noise fit: the test is about files and
    messages, and applying plain.pt reads the fit instead of computing it again (seconds each)."""
    shutil.copytree(plain_fit, cache_dir, dirs_exist_ok=True)


@pytest.fixture
def work(made, tmp_path, cli):
    """A folder with copies of the checkpoints, and ``run(*args)``: the CLI run inside it (the user
    cache is a sibling folder)."""
    folder = tmp_path / "work"
    folder.mkdir()
    for p in made.iterdir():
        if p.is_file():
            shutil.copy2(p, folder / p.name)

    def run(*args, env=None):
        return cli(*args, env=env, cwd=folder)

    run.path = folder
    return run


def attention_of_first_block(model, grid_tokens):
    """timm's own first block on the model's own position embedding (prefix rows dropped): its
    attention ``[heads, N, N]``, taken from the block's forward pass."""
    blk = model.blocks[0]
    blk.attn.fused_attn = False
    seen = []
    hook = blk.attn.attn_drop.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    with torch.no_grad():
        blk.attn(blk.norm1(model.pos_embed[:, -grid_tokens:]))
    hook.remove()
    return seen[0][0]


def hit_and_mass(attn, grid, offsets):
    from structinit.geometry.targets import impulse_columns

    cols = torch.from_numpy(impulse_columns(grid, np.array(offsets)))  # [heads, N]
    has = cols >= 0
    on = attn.gather(-1, cols.clamp(min=0).unsqueeze(-1)).squeeze(-1) * has
    hit = (attn.argmax(-1) == cols) & has
    rows = has.sum(-1)  # per head, as the reports average them
    return float((hit.sum(-1) / rows).mean()), float((on.sum(-1) / rows).mean())


# --------------------------------------------------------------------------- mounts

def _mount(path: Path, size: str, ro: bool = False) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@contextlib.contextmanager
def small_disk(path: Path, size="16k"):
    """A real, tiny file system at ``path`` (tmpfs), or skip where mounting is not allowed."""
    if not _mount(path, size):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); the RLIMIT_FSIZE tests still run")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_disk(path: Path, content=()):
    """A real read-only file system at ``path`` holding copies of ``content`` (a tmpfs remounted
    read-only). Root ignores file permissions, so chmod cannot make one: skip where mounting fails."""
    if not _mount(path, "4m"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); root ignores chmod, so no "
                    "read-only folder can be made")
    try:
        for src in content:
            shutil.copy2(src, path / Path(src).name)
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_with_file_limit(args, limit_bytes, cwd, env=None):
    """The real entry point in a subprocess that may not write files larger than ``limit_bytes``
    (``RLIMIT_FSIZE``; a write past it fails with EFBIG, as on a full disk)."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "structinit", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, preexec_fn=limit, timeout=600)


# --------------------------------------------------------------------------- silently wrong, now right or refused

@pytest.mark.slow  # the default noise fit and a solve for a learned embedding: seconds on one core
def test_learned_position_embedding_is_refused_fitted_or_replaced_and_reported_truthfully(work):
    import timm  # noqa: F401

    before = files(work.path)
    r = work("apply", "learned.pth", "--heads", HEADS, "--data-fit", "0")  # the plain solve would not fit it
    one_error(r, 2, "pos_embed", "--fit-pe", "--set-pe sincos")
    assert files(work.path) == before

    # no option: as on the model, the sin-cos table in its place (the class token's row kept), then the fit
    r = work("apply", "learned.pth", "--heads", HEADS, "--out", "auto.pth", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["pos_embed_written"] == "sin-cos table x1 in place of the checkpoint's own pos_embed, kept learnable"
    assert rep["measured_on"] == "pos_embed (sincos), LayerNorm'd" and rep["data_fit"]["inputs"] == "noise"
    orig, auto = (torch.load(work.path / name, weights_only=True) for name in ("learned.pth", "auto.pth"))
    from structinit.geometry.embedding import sincos_2d

    assert torch.equal(auto["pos_embed"][0, 0], orig["pos_embed"][0, 0])
    assert np.allclose(auto["pos_embed"][0, 1:].numpy(), sincos_2d((8, 8), DIM), atol=1e-6)

    # --fit-pe: solved for the embedding it has, and the report is what timm's own block computes on it
    r = work("apply", "learned.pth", "--heads", HEADS, "--fit-pe", "--data-fit", "0", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["measured_on"] == "pos_embed (other), LayerNorm'd" and rep["artifact"]["config"]["pos_embed"]
    model = timm_vit(class_token=True, learned=True, seed=9)
    model.load_state_dict(torch.load(work.path / "learned.impulse.pth", weights_only=True))
    hit, mass = hit_and_mass(attention_of_first_block(model, 64), (8, 8), rep["layers"][0]["offsets"])
    assert hit == pytest.approx(rep["layers"][0]["hit_rate"], abs=1e-6) and hit > 0.95
    assert mass == pytest.approx(rep["layers"][0]["target_mass"], abs=1e-4)

    # --set-pe sincos: measured on the written table
    r = work("apply", "learned.pth", "--heads", HEADS, "--set-pe", "sincos", "--out", "sc.pth", "--data-fit", "0",
             "--json")
    rep = json.loads(r.stdout)
    assert rep["measured_on"] == "pos_embed (sincos), LayerNorm'd" and rep["hit_rate"] == 1.0
    model.load_state_dict(torch.load(work.path / "sc.pth", weights_only=True))
    assert hit_and_mass(attention_of_first_block(model, 64), (8, 8), rep["layers"][0]["offsets"])[0] == 1.0

    # what the old report hid: the sin-cos solve on the learned embedding, measured on it
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.registry import init_spec
    from structinit.solver.run import solve

    sd = torch.load(work.path / "learned.pth", weights_only=True)
    view = AttentionTarget(sd, heads=HEADS)
    spec = init_spec("impulse")
    art = solve(spec.solve_config(view.grid, DIM, HEADS, 2)).artifact
    with pytest.raises(UsageError, match="not the sin-cos table"):
        spec.apply(view, artifact=art)
    from structinit.analysis.quality import measure
    from structinit.geometry.targets import impulse_columns

    honest = measure(view.own_input(), art.q[0], art.k[0], impulse_columns((8, 8), art.offsets[0]))
    assert float(honest.hit_rate.mean()) < 0.6  # far from the 1.000 the old report claimed


def test_impulse_on_a_model_never_fits_the_sin_cos_table_silently(tmp_path):
    from structinit.geometry.embedding import sincos_2d
    from structinit.init.initialize import initialize_model
    from structinit.solver.cache import find_cached
    from structinit.solver.config import SolveConfig

    # on a learned embedding the sin-cos table it solves for is written, and said (the plain solve, to measure it)
    plain = timm_vit(learned=True)
    rep = initialize_model(plain, "impulse", data_fit=0)
    assert rep["pos_embed_written"] == "sin-cos table x1 in place of the model's own pos_embed, kept learnable"
    assert rep["measured_on"] == "pos_embed (sincos), LayerNorm'd" and plain.pos_embed.requires_grad
    assert np.allclose(plain.pos_embed.detach()[0].numpy(), sincos_2d((8, 8), DIM), atol=1e-6)
    hit, _ = hit_and_mass(attention_of_first_block(plain, 64), (8, 8), rep["layers"][0]["offsets"])
    assert hit == pytest.approx(rep["layers"][0]["hit_rate"], abs=1e-6) and hit > 0.95

    model = timm_vit(learned=True)
    first = initialize_model(model, "impulse", fit_pe=True, data_fit=0)
    assert first["artifact"]["cached"] is False and first["hit_rate"] > 0.95
    assert first["measured_on"] == "pos_embed (other), LayerNorm'd"
    hit, mass = hit_and_mass(attention_of_first_block(model, 64), (8, 8), first["layers"][0]["offsets"])
    assert hit == pytest.approx(first["layers"][0]["hit_rate"], abs=1e-6)
    assert mass == pytest.approx(first["layers"][0]["target_mass"], abs=1e-4) and mass == pytest.approx(0.3, abs=0.01)
    again = initialize_model(model, "impulse", fit_pe=True, data_fit=0)  # same embedding: the same key, a cache hit
    assert again["artifact"]["cached"] is True and again["artifact"]["key"] == first["artifact"]["key"]
    with torch.no_grad():
        model.pos_embed.add_(1e-3)
    moved = initialize_model(model, "impulse", fit_pe=True, data_fit=0)  # another embedding: another key
    assert moved["artifact"]["cached"] is False and moved["artifact"]["key"] != first["artifact"]["key"]
    learned_requires_grad = model.pos_embed.requires_grad
    initialize_model(model, "impulse", pe_scale=1.0, data_fit=0)  # the table written into a learned embedding...
    assert model.pos_embed.requires_grad == learned_requires_grad  # ...which stays learnable

    # sin-cos solves keep their keys: no pos_embed in the canonical JSON, the shipped artifacts still hit
    config = SolveConfig(grid=(8, 8), dim=64, heads=4, layers=4)
    assert "pos_embed" not in config.to_dict() and config.key == SHIPPED_KEY
    assert find_cached(config.filename, tmp_path / "empty") is not None
    from structinit.training.models import ModelConfig, build_model

    digits = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1)
    rep = initialize_model(digits, "impulse", data_fit=0)
    assert rep["artifact"]["cached"] is True and "pos_embed" not in rep["artifact"]["config"]


def test_a_class_token_grid_is_asked_for_not_guessed(work):
    from structinit.geometry.embedding import sincos_2d
    from structinit.init.layouts import detect_layout

    sd = torch.load(work.path / "rect.pth", weights_only=True)
    det = detect_layout(sd)
    assert det.grid is None and "13x13" in det.grid_note and "168" in det.grid_note
    before = files(work.path)
    one_error(work("apply", "rect.pth", "--heads", HEADS, "--dry-run"), 2, "--grid", "13x13", "168 tokens")
    one_error(work("apply", "rect.pth", "--heads", HEADS, "--grid", "10x10"), 2, "100 tokens", "169 rows")
    assert files(work.path) == before
    r = work("apply", "rect.pth", "--heads", HEADS, "--grid", "14x12", "--set-pe", "sincos", "--out", "r.pth",
             "--data-fit", "0")  # the plain solve: a fit on 168 tokens takes seconds and is not what this tests
    assert r.returncode == 0, r.stderr
    new = torch.load(work.path / "r.pth", weights_only=True)
    assert torch.equal(new["pos_embed"][0, 0], sd["pos_embed"][0, 0])  # the class token's row is kept
    assert np.array_equal(new["pos_embed"][0, 1:].numpy(), sincos_2d((14, 12), DIM))


@pytest.mark.slow
def test_inspect_png_never_replaces_a_file_unless_forced(work):
    (work.path / "mine.png").write_bytes(b"precious")
    before = files(work.path)
    one_error(work("inspect", SHIPPED_KEY, "--png", "vit.pth"), 2, ".png")
    one_error(work("inspect", SHIPPED_KEY, "--png", "mine.png"), 2, "already exists", "--force")
    assert files(work.path) == before
    r = work("inspect", SHIPPED_KEY, "--png", "mine.png", "--force")
    assert r.returncode == 0 and (work.path / "mine.png").read_bytes()[:4] == b"\x89PNG"


def test_in_place_never_overwrites_a_backup_and_keeps_the_file_mode(work):
    src = work.path / "plain.pt"
    os.chmod(src, 0o600)
    original = src.read_bytes()
    (work.path / "plain.pt.bak.2").write_bytes(b"the user's own file")
    outs = []
    for _ in range(3):  # the plain solve: each apply changes the weights, so each would fit again (seconds)
        r = work("apply", "plain.pt", "--heads", HEADS, "--data-fit", "0", "--in-place", "--json")
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["backup"])
        assert (src.stat().st_mode & 0o777) == 0o600
    assert [Path(b).name for b in outs] == ["plain.pt.bak", "plain.pt.bak.1", "plain.pt.bak.3"]
    assert (work.path / "plain.pt.bak").read_bytes() == original
    assert (work.path / "plain.pt.bak.2").read_bytes() == b"the user's own file"
    assert all((Path(b).stat().st_mode & 0o777) == 0o600 for b in outs)
    out = work("apply", "plain.pt", "--heads", HEADS, "--data-fit", "0", "--out", "copy.pt")
    assert out.returncode == 0 and (work.path / "copy.pt").stat().st_mode & 0o777 == 0o600


@pytest.mark.usefixtures("fitted")
def test_the_output_format_follows_the_output_name(work):
    from safetensors.torch import load_file

    r = work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", "o.safetensors")
    assert r.returncode == 0, r.stderr
    st = load_file(work.path / "o.safetensors")
    r = work("apply", "o.safetensors", "--heads", HEADS, "--out", "back.pth", "--artifact", SHIPPED_KEY,
             "--layers", "0-1", "--data-fit", "0")  # its weights are new: a fit would take seconds
    assert r.returncode == 0, r.stderr
    assert (work.path / "back.pth").read_bytes()[:4] == b"PK\x03\x04"  # a torch.save zip
    back = torch.load(work.path / "back.pth", weights_only=True)
    assert set(back) == set(st) and all(back[k].dtype == st[k].dtype for k in st)
    before = files(work.path)
    one_error(work("apply", "vit.pth", "--heads", HEADS, "--out", "x.safetensors"), 2, "epoch", ".pt/.pth")
    assert files(work.path) == before
    # a file's content says what it is, whatever its name
    shutil.copy(work.path / "o.safetensors", work.path / "misnamed.pth")
    assert work("inspect", "misnamed.pth", "--heads", HEADS).returncode == 0


@pytest.mark.usefixtures("fitted")
def test_existing_outputs_are_refused_unless_forced(work):
    (work.path / "taken.pt").write_bytes(b"keep me")
    (work.path / "plain.impulse.pt").write_bytes(b"keep me too")
    before = files(work.path)
    one_error(work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", "taken.pt"), 2, "already exists",
              "--force")
    one_error(work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT), 2, "default output name", "--out")
    one_error(work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", "plain.pt"), 2, "--in-place")
    one_error(work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", "no/such/dir/o.pt"), 2, "does not exist")
    one_error(work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", "o.pt", "--in-place"), 2, "not both")
    assert files(work.path) == before
    r = work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", "taken.pt", "--force")
    assert r.returncode == 0 and (work.path / "taken.pt").read_bytes()[:2] == b"PK"


@pytest.mark.slow
@pytest.mark.usefixtures("fitted")
def test_concurrent_writers_to_one_name_one_wins_and_the_others_are_told(work, cache_dir):
    work("solve", "--tokens", 64, "--dim", DIM, "--heads", HEADS, "--layers", 2)  # both then read the cache
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "STRUCTINIT_CACHE": str(cache_dir)}
    cmd = [sys.executable, "-m", "structinit", "apply", "plain.pt", "--heads", str(HEADS), *QUICK_FIT, "--out",
           "same.pt"]
    procs = [subprocess.Popen(cmd, cwd=work.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    winners = [r for r in results if r[0] == 0]
    losers = [r for r in results if r[0] != 0]
    assert len(winners) == 1 and winners[0][1].startswith("wrote same.pt: "), results
    for code, out, err in losers:
        line = one_error(subprocess.CompletedProcess(cmd, code, out, err), code)
        assert "already exists" in line or "appeared while" in line
    assert sorted(p.name for p in work.path.iterdir() if p.name.startswith(".")) == []  # no temp files left
    assert "blocks.1.attn.qkv.weight" in torch.load(work.path / "same.pt", weights_only=True)  # whole and valid


@pytest.mark.parametrize("args, needle", [
    (["apply", "plain.pt", "--heads", "4", "--set-pe", "sincos", "--pe-scale", "nan"], "--pe-scale"),
    (["apply", "plain.pt", "--heads", "4", "--set-pe", "sincos", "--pe-scale", "inf"], "--pe-scale"),
    (["apply", "plain.pt", "--heads", "4", "--set-pe", "sincos", "--pe-scale", "-1"], "--pe-scale"),
    (["apply", "plain.pt", "--heads", "4", "--set-pe", "sincos", "--pe-scale", "0"], "--pe-scale"),
    (["apply", "plain.pt", "--heads", "4", "--target-mass", "nan"], "--target-mass"),
    (["apply", "plain.pt", "--heads", "4", "--target-mass", "1.5"], "--target-mass"),
    (["apply", "plain.pt", "--heads", "4", "--target-mass", "-0.2"], "--target-mass"),
    (["apply", "plain.pt", "--heads", "4", "-p", "tolerance=-1"], "tolerance"),
    (["apply", "plain.pt", "--heads", "4", "--recipe-param", "ridge=-1"], "ridge"),
    (["apply", "plain.pt", "--heads", "4", "--method", "mimetic", "-p", "alpha1=inf"], "alpha1"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--ridge", "-1"], "--ridge"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--ridge", "nan"], "--ridge"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--target-mass", "nan"], "--target-mass"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--target-mass", "1"], "--target-mass"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--recipe", "paper", "--lr", "inf"], "--lr"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--recipe", "paper", "--lr", "-1"], "--lr"),
    (["bench", "solver", "--tokens", "16", "--dim", "16", "--heads", "2", "--recipes", "fast", "--target-mass",
      "nan"], "--target-mass"),
    (["train", "--epochs", "1", "--lr", "nan"], "--lr"),
    (["train", "--epochs", "1", "--min-lr", "inf"], "--min-lr"),
    (["train", "--epochs", "1", "--weight-decay", "-1"], "--weight-decay"),
    (["train", "--epochs", "1", "--warmup-epochs", "nan"], "--warmup-epochs"),
    (["train", "--epochs", "1", "--opt-eps", "0"], "--opt-eps"),
    (["train", "--epochs", "1", "--grad-clip", "-inf"], "--grad-clip"),
    (["train", "--epochs", "1", "--label-smoothing", "1"], "--label-smoothing"),
    (["train", "--epochs", "1", "--mlp-ratio", "nan"], "--mlp-ratio"),
    (["train", "--epochs", "1", "--drop-path", "nan"], "--drop-path"),
    (["train", "--epochs", "1", "--init", "impulse", "-p", "target_mass=nan"], "target_mass"),
    (["train", "--epochs", "1", "--init", "impulse", "-p", "filter=abc"], "filter"),
])
def test_every_float_option_refuses_non_finite_and_out_of_range_values(work, args, needle, cache_dir):
    before = files(work.path)
    one_error(work(*args), 2, needle)
    assert files(work.path) == before
    assert not list(Path(cache_dir).glob("*.safetensors"))


@pytest.mark.parametrize("args, needles", [
    (["inspect", "plain.pt", "--heads", "4", "--png", "x.png"], ["--png", "checkpoint"]),
    (["inspect", "plain.pt", "--heads", "4", "--layer", "1"], ["--layer", "checkpoint"]),
    (["inspect", "plain.pt", "--heads", "4", "--head", "1"], ["--head", "checkpoint"]),
    (["inspect", "plain.pt", "--heads", "4", "--query", "3"], ["--query", "checkpoint"]),
    (["inspect", SHIPPED_KEY, "--heads", "4"], ["--heads", "artifact"]),
    (["inspect", SHIPPED_KEY, "--grid", "8x8"], ["--grid", "artifact"]),
    (["inspect", "--layer", "1"], ["--layer", "listing"]),
    (["apply", "plain.pt", "--heads", "4", "--method", "kaiming", "--filter", "5"],
     ["--filter", "kaiming init does not have"]),
    (["apply", "plain.pt", "--heads", "4", "--method", "mimetic", "--target-mass", "0.5"],
     ["--target-mass", "mimetic"]),
    (["apply", "plain.pt", "--heads", "4", "--method", "mimetic", "--fit-pe"], ["--fit-pe", "mimetic"]),
    (["apply", "plain.pt", "--heads", "4", "--pe-scale", "2"], ["--pe-scale", "--set-pe"]),
    (["apply", "plain.pt", "--heads", "4", "--fit-pe", "--artifact", SHIPPED_KEY], ["--fit-pe", "--artifact"]),
    (["apply", "plain.pt", "--heads", "4", "--recipe", "paper", "--target-mass", "0.5"], ["--target-mass", "paper"]),
    (["bench", "solver", "--recipes", "fast", "--iters", "10"], ["--iters"]),
    (["bench", "solver", "--recipes", "paper", "--target-mass", "0.5"], ["--target-mass"]),
    (["bench", "solver", "--recipes", "paper,fast", "--target-mass", "0.5"], ["--target-mass", "--match none"]),
    (["bench", "solver", "--recipes", "fast,paper", "--match", "released"], ["--match released"]),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--iters", "10"], ["--iters", "fast"]),
    (["train", "--epochs", "1", "--image-size", "16"], ["--image-size", "imagefolder"]),
    (["train", "--epochs", "1", "--data-dir", "."], ["--data-dir", "digits"]),
    (["train", "--epochs", "1", "--dataset", "synthetic", "--download"], ["--download", "synthetic"]),
])
def test_options_that_do_not_apply_are_errors_naming_the_mode(work, args, needles):
    before = files(work.path)
    one_error(work(*args), 2, *needles)
    assert files(work.path) == before


@pytest.mark.parametrize("spec", ["-1", "", "2-1", "x", "0,,1", "9", "-", "1--2"])
def test_layer_selections_count_from_zero_and_are_never_empty(work, spec):
    one_error(work("apply", "plain.pt", "--heads", HEADS, f"--layers={spec}", "--dry-run"), 2, "--layers")


def test_open_ended_layer_ranges_work(work):
    r = work("apply", "plain.pt", "--heads", HEADS, "--layers", "1-", "--dry-run", "--json")
    assert [row["layer"] for row in json.loads(r.stdout)["layers"]] == [1]


@pytest.mark.parametrize("args, needle", [
    (["apply", "plain.pt", "--heads", "4", "--out", ""], "'--out' / '-o': needs a name"),
    (["apply", "plain.pt", "--heads", "4", "--out", "."], "is a folder"),
    (["inspect", SHIPPED_KEY, "--png", ""], "--png needs a file name"),
    (["inspect", SHIPPED_KEY, "--png", "."], "is a folder"),
    (["train", "--epochs", "1", "--out", ""], "'--out'"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--cache-dir", ""], "'--cache-dir'"),
    (["train", "--epochs", "1", "--init", "impulse", "--init-param", "filter=abc"], "filter must be an integer"),
    (["solve", "--grid", "0x5", "--dim", "16", "--heads", "2"], "--grid"),
    (["solve", "--grid", "abc", "--dim", "16", "--heads", "2"], "--grid"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--threads", "0"], "--threads"),
    (["solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--cache-dir", "plain.pt"], "not a folder"),
    (["inspect", "--cache-dir", "/nonexistent/cache"], "does not exist"),
    (["inspect", "--cache-dir", "plain.pt"], "not a folder"),
    (["bench", "solver", "--recipes", ""], "--recipes"),
])
def test_bad_values_are_one_line_not_a_traceback(work, args, needle):
    before = files(work.path)
    one_error(work(*args), 2, needle)
    assert files(work.path) == before


def test_unreadable_inputs_are_one_line(work):
    (work.path / "notes.pth").write_text("hello world\n")
    (work.path / "empty.pt").write_bytes(b"")
    one_error(work("apply", "notes.pth", "--heads", HEADS), 1, "not a checkpoint")
    one_error(work("apply", "empty.pt", "--heads", HEADS), 1, "the file is empty")
    one_error(work("inspect", "notes.pth"), 1, "not a checkpoint")
    zero = timm_vit().state_dict()
    zero["pos_embed"].zero_()
    torch.save(zero, work.path / "zero.pt")
    one_error(work("apply", "zero.pt", "--heads", HEADS, "--data-fit", "0"), 2, "not the sin-cos table")
    # a path that names no checkpoint file is a usage error, for apply as for inspect
    one_error(work("apply", "missing.pt", "--heads", HEADS), 2, "missing.pt: no such file")
    one_error(work("apply", ".", "--heads", HEADS), 2, "is a folder")


@pytest.mark.slow
def test_a_malicious_pickle_is_named_and_nothing_else_is_printed(made, tmp_path):
    shutil.copy2(made / "evil.pth", tmp_path / "evil.pth")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["apply", "evil.pth", "--heads", "4"], ["inspect", "evil.pth"]):
        r = subprocess.run([sys.executable, "-m", "structinit", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
        line = one_error(r, 1, "asks to run code", "posix.system", "nothing of it was run")
        assert "Warning" not in line
    assert not (made / "pwned").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["evil.pth"]


@pytest.mark.usefixtures("fitted")
def test_in_place_through_a_symlink_replaces_the_file_and_keeps_the_link(work):
    real = work.path / "real.pt"
    shutil.copy2(work.path / "plain.pt", real)
    (work.path / "link.pt").symlink_to(real)
    r = work("apply", "link.pt", "--heads", HEADS, *QUICK_FIT, "--in-place")
    assert r.returncode == 0, r.stderr
    assert (work.path / "link.pt").is_symlink() and (work.path / "real.pt.bak").exists()
    assert real.read_bytes() != (work.path / "plain.pt").read_bytes()


def test_a_solve_that_cannot_fit_is_refused_before_it_starts(work, cache_dir):
    r = work("solve", "--tokens", 1000000, "--dim", 768, "--heads", 12)
    one_error(r, 1, "GiB of memory", "free")
    assert not [p for p in Path(cache_dir).rglob("*") if p.is_file() and not p.name.endswith(".lock")]


# --------------------------------------------------------------------------- full and read-only disks

@pytest.mark.slow
@pytest.mark.usefixtures("fitted")
def test_full_disk(work, tmp_path_factory):
    disk = tmp_path_factory.mktemp("full") / "disk"
    with small_disk(disk, "16k"):
        one_error(work("inspect", SHIPPED_KEY, "--png", disk / "att.png"), 1, "No space left")
        assert files(disk) == {}
        one_error(work("solve", "--tokens", 64, "--dim", DIM, "--heads", HEADS, "--layers", 3, "--cache-dir", disk),
                  1, "No space left", "nothing was stored")
        assert not [p for p in disk.rglob("*") if p.suffix in (".safetensors", ".tmp")]
        before = files(work.path)
        one_error(work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", disk / "o.pt"), 1, "No space left")
        assert not [p for p in disk.rglob("*") if p.is_file() and p.suffix != ".lock"] and files(work.path) == before
        one_error(work("train", "--dataset", "synthetic", "--epochs", 1, "--out", disk / "run" / "a"), 1,
                  "No space left")
        assert list(disk.iterdir()) == [] or [p.name for p in disk.iterdir()] == [".locks"]


@pytest.mark.slow
@pytest.mark.usefixtures("fitted")
def test_files_past_a_size_limit_fail_cleanly(work):
    """The full-disk cases without a mount: RLIMIT_FSIZE makes every write past the limit fail."""
    import matplotlib.font_manager  # noqa: F401  (its font cache exists before the limited runs)

    assert work("solve", "--tokens", 64, "--dim", DIM, "--heads", HEADS, "--layers", 2).returncode == 0
    for args in (["apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", "o.pt"],
                 ["inspect", SHIPPED_KEY, "--png", "att.png"],
                 ["train", "--dataset", "synthetic", "--epochs", "1", "--out", "run"]):
        before = files(work.path)
        r = run_with_file_limit(args, 4096, work.path, env={"OMP_NUM_THREADS": "1"})
        one_error(r, 1, "File too large")
        assert files(work.path) == before and not (work.path / "run").exists()


@pytest.mark.usefixtures("fitted")
def test_read_only_disk(work, made, tmp_path_factory):
    disk = tmp_path_factory.mktemp("ro") / "disk"
    with read_only_disk(disk, content=[made / "plain.pt"]):
        before = files(disk)
        one_error(work("inspect", SHIPPED_KEY, "--png", disk / "att.png"), 1, "Read-only file system")
        solve = ["solve", "--tokens", 64, "--dim", DIM, "--heads", HEADS, "--layers", 3]  # not a shipped shape
        one_error(work(*solve, "--cache-dir", disk), 1, "Read-only")
        one_error(work(*solve, "--cache-dir", disk / "sub"), 1, "Read-only")
        # apply solves before it writes: on a slow machine the solve prints progress lines first
        one_error(work("apply", disk / "plain.pt", "--heads", HEADS, *QUICK_FIT, "--in-place"), 1, "Read-only")
        one_error(work("apply", "plain.pt", "--heads", HEADS, *QUICK_FIT, "--out", disk / "o.pt"), 1, "Read-only")
        one_error(work("train", "--dataset", "synthetic", "--epochs", 1, "--out", disk / "run"), 1, "Read-only")
        assert files(disk) == before


# --------------------------------------------------------------------------- minor cases

def test_a_half_precision_sin_cos_table_is_still_the_table(work):
    sd = {k: v.half() for k, v in timm_vit().state_dict().items()}
    torch.save(sd, work.path / "half.pt")
    r = work("apply", "half.pt", "--heads", HEADS, "--data-fit", "0", "--json")  # the table is read before any fit
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["measured_on"] == "pos_embed (sincos), LayerNorm'd"


def test_default_names_modes_and_json(work):
    shutil.copy2(work.path / "vit.pth", work.path / "run.pth.tar")
    r = work("apply", "run.pth.tar", "--heads", HEADS, "--dry-run", "--json")
    assert json.loads(r.stdout)["output"].endswith("run.impulse.pth.tar")
    doc = json.loads(work("inspect", SHIPPED_KEY, "--json").stdout)
    assert isinstance(doc["config"], dict) and doc["config"]["heads"] == 4


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="imports the package without mutmut's path set-up")
def test_python_m_structinit_beside_a_folder_named_structinit(tmp_path):
    """From a folder holding a clone named structinit/, with structinit installed in editable mode
    (setuptools' own editable finder), `python -m structinit` still runs the real package."""
    from setuptools.command.editable_wheel import _finder_template

    (tmp_path / "structinit" / "docs").mkdir(parents=True)  # the clone: no __init__.py at its top
    finder = tmp_path / "finder"
    finder.mkdir()
    (finder / "si_finder.py").write_text(_finder_template("si_finder", {"structinit": str(REPO / "structinit")}, {}))
    code = ("import sys; sys.path.insert(1, sys.argv[1]);"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')];"
            "import si_finder; si_finder.install(); import runpy; sys.argv = ['structinit', '--version'];"
            "runpy.run_module('structinit', run_name='__main__', alter_sys=True)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code, str(finder)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("structinit "), r.stderr


def test_train_never_writes_over_files_a_run_would_write(work):
    (work.path / "proj").mkdir()
    (work.path / "proj" / "config.json").write_text('{"mine": true}')
    before = files(work.path)
    one_error(work("train", "--dataset", "synthetic", "--epochs", "1", "--out", "proj"), 2, "config.json", "--resume")
    one_error(work("train", "--dataset", "synthetic", "--epochs", "1", "--out", "proj", "--resume"), 1,
              "config.json")
    assert files(work.path) == before


@pytest.mark.slow  # over 10 s on one core: a full training or Hugging Face round trip, or many CLI calls
def test_resume_takes_the_runs_settings_and_names_real_differences(work):
    args = ["train", "--dataset", "synthetic", "--epochs", "1", "--out", "run"]
    assert work(*args, env={"OMP_NUM_THREADS": "1"}).returncode == 0
    r = work("train", "--out", "run", "--resume")
    assert r.returncode == 0 and "finished all 1 epochs already" in r.stderr
    line = one_error(work("train", "--out", "run", "--resume", "--epochs", "2"), 2, "epochs 1 in the run, 2 now")
    assert "None" not in line


# --------------------------------------------------------------------------- help that works as written

def _examples(path):
    import io

    from structinit.cli.app import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*path, "--help"])
    text = out.getvalue()
    lines = text.split("Examples:")[1].strip().splitlines() if "Examples:" in text else []
    if not path:
        lines = [text.split("Example: ")[1].splitlines()[0]]
    return [line.split("  #")[0].strip() for line in lines if line.strip()]


def _example_inputs(folder: Path, examples):
    """The files the examples name, made only where an example names them: a 6-layer ViT with 3
    heads (vit.pth), one with a learned position embedding (learned.pth), an
    nn.MultiheadAttention state dict (mha.pt), a small BERT and GPT-2 with 12 heads (bert.pt,
    gpt2.pt), a Hugging Face ViT folder (hf-vit/), and a two-row grid (my-grid.toml)."""
    named = {word for line in examples for word in shlex.split(line)}
    if named & {"vit.pth", "learned.pth"}:
        import timm

        from structinit.init.pos_embed import set_sincos_pos_embed

        torch.manual_seed(0)
        m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=2, embed_dim=48, depth=6, num_heads=3,
                              class_token=False, global_pool="avg", num_classes=10)
        set_sincos_pos_embed(m)
        torch.save(m.state_dict(), folder / "vit.pth")
        m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=2, embed_dim=48, depth=2, num_heads=3,
                              num_classes=10)
        torch.save(m.state_dict(), folder / "learned.pth")
    if "images/" in named:  # real digits upscaled to the ViT's 16x16 RGB, as PNGs in class folders
        from PIL import Image
        from sklearn.datasets import load_digits

        d = load_digits()
        for i in range(12):
            label = folder / "images" / str(d.target[i])
            label.mkdir(parents=True, exist_ok=True)
            pixels = (d.images[i] * 255 / 16).astype("uint8")
            Image.fromarray(pixels).convert("RGB").resize((16, 16)).save(label / f"{i}.png")
    if "vit_t.pth" in named:  # a ViT-T (dim 192, 12 layers) on 32x32 images in patches of 4, and its inputs
        import timm

        m = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10)
        torch.save(m.state_dict(), folder / "vit_t.pth")
        torch.save(torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(0)), folder / "inputs.pt")
    if "mha.pt" in named:
        torch.save(torch.nn.MultiheadAttention(32, 4, batch_first=True).state_dict(), folder / "mha.pt")
    if "hf-vit/" in named:  # a Hugging Face ViT folder (save_pretrained's) for the 16x16 RGB images
        from transformers import ViTConfig, ViTModel

        ViTModel(ViTConfig(image_size=16, patch_size=2, num_channels=3, hidden_size=48, num_hidden_layers=2,
                           num_attention_heads=3, intermediate_size=96)).save_pretrained(folder / "hf-vit")
    if named & {"bert.pt", "gpt2.pt"}:
        from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

        small = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=12, intermediate_size=96, vocab_size=50)
        torch.save(BertModel(BertConfig(**small)).state_dict(), folder / "bert.pt")  # 512 positions
        torch.save(GPT2LMHeadModel(GPT2Config(n_embd=48, n_layer=2, n_head=12, vocab_size=50)).state_dict(),
                   folder / "gpt2.pt")  # 1024 positions
    (folder / "my-grid.toml").write_text(variant(DIGITS, name="my-grid", epochs=1))


def _commands():
    import typer.main

    from structinit.cli.app import app

    def walk(group, path=()):
        for name, cmd in getattr(group, "commands", {}).items():
            if getattr(cmd, "commands", None):
                yield from walk(cmd, path + (name,))
            else:
                yield path + (name,)

    return [()] + list(walk(typer.main.get_command(app)))


#: Examples that cannot run here as written: what runs instead (``None``: nothing) and why.
STAND_INS = {
    "structinit bench grid digits --jobs 2": (
        "structinit bench grid digits --seeds 1 --launcher print",
        "the whole learning curve takes about an hour (one seed: the print launcher still solves each impulse "
        "artifact into the cache first, about half a minute each on a slow machine)"),
    "structinit bench grid table2 --data-dir ~/data --launcher slurm --partition gpu --gpus 1 --cpus 8 "
    "--time 12:00:00 --max-concurrent 16": (None, "needs CIFAR-10 and a cluster with a GPU partition"),
    "structinit bench run runs/3f2a9c1b7d4e": (None, "names a run folder of a launched grid (tested in test_bench_*)"),
    "structinit bench run runs/3f2a9c1b7d4e --nproc 4": (None, "names a run folder of a launched grid"),
    "structinit inspect runs/digits-imp --data digits": (
        None, "names a train run folder (tested in test_inspect_data, on a run train writes there)"),
    "structinit bench fit --model vit-digits --dataset digits --versions 1,2 --threads 1": (
        "structinit bench fit --model vit-digits --dataset digits --versions 1,2 --threads 1 --steps 5 --samples 32",
        "version 1's 300 steps on 256 digits take minutes on a slow machine; the flags are the example's"),
    "structinit bench fit --model vit-t --image-size 32 --in-chans 3 --threads 1": (
        "structinit bench fit --model vit-t --image-size 16 --in-chans 3 --threads 1 --steps 5 --samples 16 "
        "--train-steps 1", "the ViT-T shape's fit and training steps take minutes on a slow machine: one timed "
        "training step of batch 64 at 32x32 (256 tokens) alone is 15 s of CPU, at 16x16 (64 tokens) a quarter"),
    "structinit bench loop --model vit-digits --dataset digits --threads 1": (
        "structinit bench loop --model vit-digits --dataset digits --threads 1 --epochs 1 --repeats 1",
        "three repeats of two epochs of each loop take half a minute of CPU; the flags are the example's"),
    "structinit apply runs/digits/checkpoint.pt --out imp.pt --data digits": (
        None, "names a train run's checkpoint (tested in test_apply_data, on a checkpoint train writes)"),
    "structinit bench fit --model vit-s --image-size 224 --patch 16 --train-batch 128 --amp bf16 --data-free "
    "--device cuda --profile prof --profile-over 2": (
        None, "needs a CUDA GPU (scripts/device-check.sh runs it); the same flags on the CPU are tested in "
        "test_bench_speed"),
    "structinit bench loop --model vit-t --dataset noise --image-size 32 --batch-size 128 --amp bf16 "
    "--timm-model vit_tiny_patch16_224 --device cuda": (
        None, "needs a CUDA GPU (scripts/device-check.sh runs it); --timm-model and --dataset noise on the CPU "
        "are tested in test_bench_speed"),
}
#: The impulse data fit in the examples that run it (train and inspect with ``--init impulse``,
#: apply, and the quick grid): 16 images (train, inspect, the grid) and 30 Adam steps a layer where
#: the example sets neither. The default 256 images cost minutes per layer on a slow 2-core machine,
#: the default 300 steps seconds a layer on any (23 s of CPU for apply's ViT-T example), and these
#: tests are about the example's flags and files. The fit itself is tested in test_data_fit,
#: test_inspect_data and test_apply_data.
FIT_SAMPLES = 16
FIT_STEPS = 30
FIT_PARAM = ["-p", f"data_fit_samples={FIT_SAMPLES}"]
FIT_SET = ["--set", f"init_params.data_fit_samples={FIT_SAMPLES}", "--set", f"init_params.data_fit={FIT_STEPS}"]
#: The training images of train's digits and MNIST-1D examples that name no --train-size: what an
#: example tests is its flags and the files it writes, and a full epoch of digits at the default
#: model is a minute on a slow machine (MNIST-1D's 4,000 sequences, seconds). Learning itself is
#: tested in test_train and test_mnist1d.
TRAIN_SIZE = ["--train-size", "200"]
#: bench report's examples read the runs of bench grid's quick example, so the two commands'
#: examples run in one test, grid's first. bench grid's print examples write their run folders
#: elsewhere (--out printed): what they prepare is not finished runs for the report to read, and
#: `--attention` would build every one of their methods' models.
PRINTED = ["--out", "printed"]
TOGETHER = {("bench", "grid"): [("bench", "grid"), ("bench", "report")]}


def _as_run(line, folder):
    """How this test runs help example ``line`` in ``folder``: ``(argv, redirect)``, the example's
    words with its stand-in and the flags above, and the file its stdout is redirected to (``None``
    for none); ``None`` for an example that is not run here."""
    line = STAND_INS.get(line, (line, ""))[0]
    if line is None:
        return None
    argv = shlex.split(line)
    redirect = None
    if ">" in argv:  # a shell redirect of stdout
        argv, redirect = argv[:argv.index(">")], folder / argv[argv.index(">") + 1]
    fits = "impulse" in argv and "--resume" not in argv
    if argv[1:2] in (["train"], ["inspect"]) and fits:
        argv = [*argv, *FIT_PARAM]
        if not any(word.startswith("data_fit=") for word in argv):
            argv = [*argv, "-p", f"data_fit={FIT_STEPS}"]
    if argv[1:2] == ["apply"] and not {"--data-fit", "--dry-run"} & set(argv):
        argv = [*argv, "--data-fit", str(FIT_STEPS)]
    if argv[1:2] == ["train"] and {"digits", "mnist1d"} & set(argv) and not {"--train-size", "--resume"} & set(argv):
        argv = [*argv, *TRAIN_SIZE]
    if argv[1:3] == ["bench", "grid"] and "print" in argv:
        argv = [*argv, *PRINTED]
    if argv[1:3] in (["bench", "grid"], ["bench", "report"]) and "init=mimetic,impulse" in argv:
        argv = [*argv, *FIT_SET]  # the quick grid, as bench report's example reads it
    return argv, redirect


def _groups():
    paths = _commands()
    later = {p for group in TOGETHER.values() for p in group[1:]}
    return [TOGETHER.get(p, [p]) for p in paths if p not in later]


@pytest.mark.slow
@pytest.mark.parametrize("paths", _groups(), ids=lambda ps: " + ".join(" ".join(p) or "structinit" for p in ps))
def test_every_help_example_runs_as_written(paths, tmp_path, cli):
    examples = []
    for path in paths:
        found = _examples(path)
        assert found, path
        examples += found
    _example_inputs(tmp_path, examples)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for line in examples:
        run = _as_run(line, tmp_path)
        if run is None:
            continue
        argv, redirect = run
        if argv[0] == "torchrun":
            exe = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
            r = subprocess.run([exe, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        else:
            assert argv[0] == "structinit", line
            r = cli(*argv[1:], cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, (line, r.stderr[-3000:])
        if redirect is not None:
            redirect.write_text(r.stdout)
            assert r.stdout.strip(), line
