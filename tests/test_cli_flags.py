"""Every flag of solve, apply and inspect traced to what it changes (the artifact, the written
checkpoint, the run), and every number the commands print compared with the artifact's or the
checkpoint's own. In process, through the same ``main`` the console script runs."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import error_line

from structinit.analysis.quality import artifact_attention, measure
from structinit.geometry.embedding import pseudo_input, sincos
from structinit.geometry.targets import centre_first_order, draw_offsets, impulse_columns, kernel_offset
from structinit.init.checkpoints import describe_checkpoint
from structinit.init.inject import rows_to_heads
from structinit.solver.artifact import read_artifact

SHAPE = ["--tokens", "16", "--dim", "16", "--heads", "2"]


def run_json(cli, *args):
    r = cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --------------------------------------------------------------------------- solve

@pytest.mark.parametrize("args, config, params", [
    ([], {"share": False, "layers": 1, "recipe": "fast", "seed": 0}, {"target_mass": 0.3, "ridge": 1e-5}),
    (["--depth", "3", "--share"], {"share": True, "layers": 3}, {}),
    (["--layers", "2"], {"share": False, "layers": 2}, {}),
    (["--target-mass", "0.6", "--ridge", "1e-4"], {}, {"target_mass": 0.6, "ridge": 1e-4}),
    (["--recipe", "paper", "--iters", "20", "--lr", "0.01"], {"recipe": "paper"}, {"iters": 20, "lr": 0.01}),
    (["-r", "released", "--iters", "20", "--norm-every", "5"], {"recipe": "released"},
     {"iters": 20, "lr": 1e-4, "norm_every": 5}),
    (["--recipe", "closed-form"], {"recipe": "closed-form"}, {"logit": 10.0, "noise_std": 1.0, "qk_scale": 7.0}),
    (["--pseudo-input", "pe+uniform", "--pseudo-input-rest", "gaussian", "--depth", "2"],
     {"pseudo_input": "pe+uniform", "pseudo_input_rest": "gaussian"}, {}),
    (["--padding", "circular", "--offsets", "centre", "--seed", "4", "-f", "3"],
     {"padding": "circular", "offset_order": "centre", "seed": 4, "filter": 3}, {}),
])
def test_solve_flags_reach_the_artifact(cli, cache_dir, args, config, params):
    doc = run_json(cli, "solve", *SHAPE, *args)
    art = read_artifact(doc["path"])
    got = art.config.to_dict()
    assert {k: got[k] for k in config} == config and {k: art.config.params[k] for k in params} == params
    assert doc["config"] == got and doc["key"] == art.key and doc["offsets"] == art.offsets.tolist()
    assert doc["stats"] == art.stats and doc["cached"] is False and art.path.parent == cache_dir
    assert (got["grid"], got["dim"], got["heads"]) == ([4, 4], 16, 2)
    c = art.config
    if c.share:
        assert all(np.array_equal(art.q[0], art.q[l]) for l in range(c.layers))
    elif c.layers > 1 and c.offset_order == "random":
        assert not np.array_equal(art.q[0], art.q[1])
    if c.pseudo_input_rest:
        assert np.array_equal(art.pseudo_input_rest, pseudo_input(c.pseudo_input_rest, c.grid, c.dim, seed=c.seed + 1))
    assert np.array_equal(art.pseudo_input, pseudo_input(c.pseudo_input, c.grid, c.dim, seed=c.seed))
    assert np.array_equal(art.offsets, draw_offsets(c.filter, c.heads, art.offsets.shape[0] if not c.share else 1,
                                                    c.seed, c.offset_order).repeat(1 if not c.share else c.layers, 0))
    if c.recipe == "fast":
        assert art.stats["summary"]["target_mass"] == pytest.approx(c.params["target_mass"], abs=1e-3)


def test_solve_grid_forms_and_cache_flags(cli, tmp_path, cache_dir):
    assert run_json(cli, "solve", "--grid", "4x6", "--dim", "16", "--heads", "2")["config"]["grid"] == [4, 6]
    seq = run_json(cli, "solve", "--grid", "12", "--dim", "8", "--heads", "2")
    assert seq["config"]["grid"] == [12] and seq["path"].endswith(f"s12-d8-h2-f3-{seq['key']}.safetensors")
    five = run_json(cli, "solve", "--tokens", "36", "--dim", "16", "--heads", "2", "--filter", "5")
    assert five["config"]["filter"] == 5 and max(abs(v) for o in five["offsets"][0] for v in o) <= 2
    own = tmp_path / "own-cache"
    first = run_json(cli, "solve", *SHAPE, "--cache-dir", own)
    assert first["path"] == str(own / read_artifact(first["path"]).config.filename) and not first["cached"]
    assert run_json(cli, "solve", *SHAPE, "--cache-dir", own)["cached"] is True
    again = run_json(cli, "solve", *SHAPE, "--cache-dir", own, "--force", "--device", "cpu", "--threads", "1")
    assert again["cached"] is False and again["key"] == first["key"] and again["path"] == first["path"]
    assert not list(cache_dir.glob("*.safetensors")) or all(own not in p.parents for p in cache_dir.iterdir())


def _table_rows(text):
    """``(layer, head, (dy, dx), mse, hit, mass, |q|, |k|)`` of every row of a quality table."""
    pat = re.compile(r"^\s*(\d+)\s+(\d+)\s+\((-?\d+),(-?\d+)\)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$")
    rows = []
    for line in text.splitlines():
        m = pat.match(line)
        if m:
            g = m.groups()
            rows.append((int(g[0]), int(g[1]), (int(g[2]), int(g[3])), *map(float, g[4:])))
    return rows


def _mean_row(text):
    m = re.search(r"^\s*mean\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", text, re.M)
    return tuple(map(float, m.groups()))


def assert_table_matches(text, art):
    rows = _table_rows(text)
    L, H = art.config.layers, art.config.heads
    assert [(r[0], r[1]) for r in rows] == [(l, h) for l in range(L) for h in range(H)]
    for l, h, off, mse, hit, mass, qn, kn in rows:
        cell = art.stats["layers"][l][h]
        assert off == tuple(art.offsets[l, h])
        assert mse == pytest.approx(cell["mse"], rel=2e-3) and hit == pytest.approx(cell["hit_rate"], abs=5e-4)
        assert mass == pytest.approx(cell["target_mass"], abs=5e-4)
        assert qn == pytest.approx(cell["q_norm"], abs=5e-4) and kn == pytest.approx(cell["k_norm"], abs=5e-4)
    s = art.stats["summary"]
    want = (s["mse"], s["hit_rate"], s["target_mass"], s["q_norm"], s["k_norm"])
    assert _mean_row(text) == pytest.approx(want, rel=2e-3, abs=5e-4)


def test_solve_text_shows_the_artifacts_numbers(cli, cache_dir):
    args = ["solve", *SHAPE, "--depth", "2", "--target-mass", "0.55"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    art = read_artifact(next(cache_dir.glob("*.safetensors")))
    out = first.stdout
    assert f"artifact  {art.path}\n" in out
    assert re.search(rf"^key       {art.key}  \(solved in \d+\.\d{{3}} s on cpu\)$", out, re.M)
    assert ("config    4x4 grid, dim 16, 2 heads, filter 3, 2 layer(s), recipe fast (target_mass=0.55, "
            "ridge=1e-05), pseudo input pe, zero padding, seed 0") in out
    assert_table_matches(out, art)
    second = cli(*args)
    assert f"key       {art.key}  (cache hit)" in second.stdout
    shared = cli("solve", *SHAPE, "--depth", "2", "--share")
    assert "2 layer(s) shared, recipe fast" in shared.stdout


# --------------------------------------------------------------------------- apply

DIM, HEADS = 32, 4


def vit_file(tmp_path, name="vit.pth", depth=2):
    import timm

    from structinit.init.pos_embed import set_sincos_pos_embed

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, embed_dim=DIM, depth=depth,
                          num_heads=HEADS, mlp_ratio=2.0, class_token=True, global_pool="token", num_classes=3)
    set_sincos_pos_embed(m)
    path = tmp_path / name
    torch.save({"state_dict": m.state_dict(), "epoch": 2}, path)
    return path


def written(path):
    return torch.load(path, weights_only=True)["state_dict"]


def qk_of(sd, layer):
    w = sd[f"blocks.{layer}.attn.qkv.weight"]
    return rows_to_heads(w[:DIM], HEADS), rows_to_heads(w[DIM:2 * DIM], HEADS)


def test_apply_target_mass_reaches_the_solve_and_the_written_attention(cli, tmp_path):
    src = vit_file(tmp_path)
    rep = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--target-mass", "0.45")
    assert rep["artifact"]["config"]["params"]["target_mass"] == 0.45 and rep["target_mass"] == pytest.approx(0.45,
                                                                                                             abs=1e-3)
    sd = written(rep["output"])
    x = pseudo_input("pe", (4, 4), DIM)
    for row in rep["layers"]:
        q, k = qk_of(sd, row["layer"])
        got = measure(x, q, k, impulse_columns((4, 4), np.array(row["offsets"])))
        assert float(got.target_mass.mean()) == pytest.approx(0.45, abs=1e-3)  # the file's own attention
        assert float(got.hit_rate.mean()) == 1.0


def test_apply_share_offsets_seed_filter_reach_the_artifact(cli, tmp_path):
    src = vit_file(tmp_path)
    shared = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--share", "--seed", "3", "--out",
                      tmp_path / "s.pth")
    cfg = shared["artifact"]["config"]
    assert cfg["share"] is True and cfg["seed"] == 3 and cfg["layers"] == 2
    assert shared["layers"][0]["offsets"] == shared["layers"][1]["offsets"]
    sd = written(tmp_path / "s.pth")
    assert all(torch.equal(a, b) for a, b in zip(qk_of(sd, 0), qk_of(sd, 1)))
    centre = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--offsets", "centre", "-f", "3", "--out",
                      tmp_path / "c.pth")
    assert centre["artifact"]["config"]["offset_order"] == "centre" and centre["artifact"]["config"]["filter"] == 3
    want = [list(kernel_offset(k, 3)) for k in centre_first_order(3)[:HEADS]]
    assert centre["layers"][0]["offsets"] == want and centre["layers"][1]["offsets"] == want
    unshared = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--out", tmp_path / "u.pth")
    assert unshared["artifact"]["config"]["share"] is False and unshared["artifact"]["config"]["seed"] == 0


def test_apply_recipe_flags_and_an_existing_artifact(cli, tmp_path, cache_dir):
    src = vit_file(tmp_path)
    rep = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--recipe", "closed-form",
                   "--recipe-param", "qk_scale=9",
                   "--out", tmp_path / "cf.pth", "--cache-dir", tmp_path / "c")
    art = read_artifact(rep["artifact"]["path"])
    assert art.config.recipe == "closed-form" and art.config.params["qk_scale"] == 9.0
    assert art.path.parent == tmp_path / "c" and rep["artifact"]["cached"] is False
    assert np.allclose(np.linalg.norm(art.q.reshape(2, HEADS, -1), axis=-1), 9.0, rtol=1e-4)
    assert np.allclose(np.linalg.norm(art.k.reshape(2, HEADS, -1), axis=-1), 9.0, rtol=1e-4)
    for layer in (0, 1):
        assert torch.equal(qk_of(written(tmp_path / "cf.pth"), layer)[0], torch.from_numpy(art.q[layer]))
    before = sorted(p.name for p in cache_dir.glob("*"))
    again = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--artifact", art.path, "--out",
                     tmp_path / "a.pth")
    assert again["artifact"]["key"] == art.key and again["artifact"]["cached"] is None
    assert sorted(p.name for p in cache_dir.glob("*")) == before  # nothing solved
    assert torch.equal(written(tmp_path / "a.pth")["blocks.1.attn.qkv.weight"],
                       written(tmp_path / "cf.pth")["blocks.1.attn.qkv.weight"])


def test_apply_layers_vproj_pe_and_method_flags(cli, tmp_path):
    src = vit_file(tmp_path)
    orig = written(src)
    rep = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--layers", "1", "--mimetic-vproj",
                   "--set-pe", "sincos",
                   "--pe-scale", "2", "--out", tmp_path / "o.pth")
    sd = written(tmp_path / "o.pth")
    assert [r["layer"] for r in rep["layers"]] == [1] and rep["params"]["mimetic_vproj"] is True
    assert torch.equal(sd["blocks.0.attn.qkv.weight"], orig["blocks.0.attn.qkv.weight"])
    assert not torch.equal(sd["blocks.1.attn.qkv.weight"][2 * DIM:], orig["blocks.1.attn.qkv.weight"][2 * DIM:])
    assert not torch.equal(sd["blocks.1.attn.proj.weight"], orig["blocks.1.attn.proj.weight"])
    assert torch.allclose(sd["pos_embed"][0, 1:], 2 * torch.from_numpy(sincos((4, 4), DIM)))
    assert rep["set_pe"] == "sincos" and rep["pe_scale"] == 2.0 and rep["pos_embed_replaced"] == "pos_embed"
    mim = run_json(cli, "apply", src, "--heads", HEADS, "--method", "mimetic", "-p", "alpha1=0.2", "-p", "vproj=false",
                   "--seed", "5", "--out", tmp_path / "m.pth")
    assert mim["method"] == "mimetic" and mim["params"]["alpha1"] == 0.2 and mim["params"]["vproj"] is False
    assert mim["seed"] == 5 and all("hit_rate" in r for r in mim["layers"])
    msd = written(tmp_path / "m.pth")
    assert torch.equal(msd["blocks.0.attn.proj.weight"], orig["blocks.0.attn.proj.weight"])  # vproj=false
    r = cli("apply", src, "--heads", HEADS, "--method", "mimetic", "--filter", "3", "--share")
    line = error_line(r.stderr)
    assert r.returncode == 2 and "--filter, --share" in line and "mimetic init does not have" in line
    keep = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--no-mimetic-vproj", "--set-pe", "sincos",
                    "--out", tmp_path / "k.pth")  # V/proj of the checkpoint kept; Q/K written
    ksd = written(tmp_path / "k.pth")
    assert keep["params"]["mimetic_vproj"] is False and keep["mimetic_vproj"] is False
    for layer in (0, 1):
        qkv = f"blocks.{layer}.attn.qkv.weight"
        assert torch.equal(ksd[f"blocks.{layer}.attn.proj.weight"], orig[f"blocks.{layer}.attn.proj.weight"])
        assert torch.equal(ksd[qkv][2 * DIM:], orig[qkv][2 * DIM:])
        assert not torch.equal(ksd[qkv][:DIM], orig[qkv][:DIM])
    assert keep["data_fit"] is None and keep["params"]["data_fit"] == 0  # asked for the plain solve


def test_apply_method_flags_are_aliases_of_init_params_refused_where_the_method_has_none(cli, tmp_path):
    """Issue 53: each impulse flag of apply is the alias of one init parameter: with every registered
    method that has the parameter it sets what ``-p NAME=VALUE`` sets; with one that has none it is
    refused (exit 2, nothing written) naming the flag, the method and the parameters it does take."""
    import dataclasses

    from structinit.cli.apply import METHOD_FLAGS
    from structinit.init.registry import INIT_METHODS

    src = vit_file(tmp_path)
    values = {"--filter": "5", "--recipe": "paper", "--target-mass": "0.4", "--artifact": "k", "--offsets": "centre",
              "--padding": "circular", "--data-fit": "0", "--recipe-param": "iters=2"}
    for flag, name in METHOD_FLAGS.items():
        for method, cls in INIT_METHODS.items():
            takes = [f.name for f in dataclasses.fields(cls)]
            given = [flag, values[flag]] if flag in values else [flag]
            if name in takes:
                continue
            r = cli("apply", src, "--heads", HEADS, "--method", method, *given)
            line = error_line(r.stderr)
            assert r.returncode == 2 and line.startswith(f"error: {flag} sets the init parameter {name},"), line
            assert f"the {method} init does not have" in line and ", ".join(takes or ["no parameters"]) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vit.pth"]
    by_flag = run_json(cli, "apply", src, "--heads", HEADS, "--method", "impulse-2024", "--filter", "5",
                       "--recipe-param", "iters=2", "--dry-run")
    by_param = run_json(cli, "apply", src, "--heads", HEADS, "--method", "impulse-2024", "-p", "filter=5",
                        "-p", 'recipe_params={"iters": 2}', "--dry-run")
    assert by_flag["params"] == by_param["params"] == {"filter": 5, "recipe_params": {"iters": 2}}
    r = cli("apply", src, "--heads", HEADS, "--method", "impulse-2024", "--filter", "5", "-p", "filter=3")
    line = error_line(r.stderr)
    assert r.returncode == 2 and "--filter 5" in line and "filter=3" in line and "give one" in line


def test_apply_output_flags(cli, tmp_path):
    src = vit_file(tmp_path)
    before = src.read_bytes()
    plan = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--dry-run")
    assert plan["dry_run"] is True and plan["output"] == str(tmp_path / "vit.impulse.pth")
    assert not (tmp_path / "vit.impulse.pth").exists() and "written" not in plan
    rep = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--in-place")
    assert rep["in_place"] and rep["output"] == str(src) and (tmp_path / "vit.pth.bak").read_bytes() == before
    assert src.read_bytes() != before and rep["written"] is True
    r = cli("apply", src, "--heads", HEADS, "--data-fit", "0", "--in-place", "--out", tmp_path / "x.pth")
    assert r.returncode == 2 and "give either --out or --in-place" in r.stderr


def test_apply_text_shows_the_reports_numbers(cli, tmp_path):
    src = vit_file(tmp_path)
    r = cli("apply", src, "--heads", HEADS, "--data-fit", "0", "--target-mass", "0.4", "--set-pe", "sincos",
            "--verbose")
    assert r.returncode == 0, r.stderr
    rep = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--target-mass", "0.4", "--set-pe",
                   "sincos", "--dry-run")
    desc = describe_checkpoint(tmp_path / "vit.impulse.pth", heads=HEADS)
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{src}: ") and "[timm-vit], torch; state dicts: state_dict" in lines[0]
    assert lines[1] == f"  dim {DIM}, heads {HEADS}, depth 2, grid 4x4"
    assert lines[2].startswith("  method impulse (filter=3, recipe=fast, target_mass=0.4,") and "seed 0" in lines[2]
    assert "  position embedding pos_embed <- sincos x1.0" in lines
    layer_lines = [line for line in lines if line.startswith("  layer ")]
    assert len(layer_lines) == 2
    for line, row in zip(layer_lines, desc["layers"]):
        m = re.match(r"  layer\s+(\d+)  hit rate (\S+)  target mass (\S+)  replaced: (.*)$", line)
        assert int(m.group(1)) == row["layer"]
        assert float(m.group(2)) == pytest.approx(row["hit_rate"], abs=5e-4)
        assert float(m.group(3)) == pytest.approx(row["target_mass"], abs=5e-4)
        assert m.group(4).split(", ") == [x for x in rep["layers"][row["layer"]]["replaced"]]
    assert lines[-1] == f"wrote: {tmp_path / 'vit.impulse.pth'}"


# --------------------------------------------------------------------------- inspect

def test_inspect_artifact_numbers_are_the_artifacts(cli, cache_dir):
    doc = run_json(cli, "solve", *SHAPE, "--depth", "2", "--target-mass", "0.5")
    art = read_artifact(doc["path"])
    shown = run_json(cli, "inspect", art.key)
    assert shown["key"] == art.key and shown["config"] == art.config.to_dict() and shown["stats"] == art.stats
    assert shown["offsets"] == art.offsets.tolist() and shown["version"] == art.version and shown["png"] is None
    r = cli("inspect", art.key, "--layer", "1", "--head", "1", "--query", "5")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"config    {art.config.canonical_json()}" in out
    version = re.escape(art.version)
    assert re.search(rf"^key       {art.key}   \(structinit {version}, solved in \d+\.\d{{3}} s on cpu\)$", out, re.M)
    assert_table_matches(out, art)
    dy, dx = (int(v) for v in art.offsets[1, 1])
    qy, qx = divmod(5, 4)
    attn = artifact_attention(art, 1)[1, 5].reshape(4, 4)
    head = [line for line in out.splitlines() if line.startswith("layer 1 head 1 query token 5")][0]
    if 0 <= qy + dy < 4 and 0 <= qx + dx < 4:
        assert head == (f"layer 1 head 1 query token 5 (y=1, x=1), offset ({dy},{dx}) -> target (y={qy + dy}, "
                        f"x={qx + dx}) gets {attn[qy + dy, qx + dx]:.3f}")
    assert f"from 0 to max {attn.max():.3f}; Q marks the query" in out
    grid_rows = out.split(head + "\n")[1].splitlines()[:4]
    assert [len(row) for row in grid_rows] == [8] * 4 and grid_rows[1][2] == "Q"  # query (1, 1): cell 1 of row 1
    default = cli("inspect", art.key)
    assert "layer 0 head 0 query token 10 (y=2, x=2)" in default.stdout  # the grid centre


@pytest.mark.slow  # over 10 s on one core: a full training or Hugging Face round trip, or many CLI calls
def test_inspect_ranges_png_and_listing(cli, cache_dir, tmp_path):
    art = read_artifact(run_json(cli, "solve", *SHAPE)["path"])
    for args, message in ((["--layer", "1"], "--layer 1 is out of range: the artifact has 1 layer(s)"),
                          (["--head", "2"], "--head 2 is out of range: the artifact has 2 head(s)"),
                          (["--query", "16"], "--query 16 is out of range: the grid has 16 tokens"),
                          (["--layer", "-1"], "--layer -1 is out of range")):
        r = cli("inspect", art.key, *args)
        assert r.returncode == 2 and r.stderr.startswith(f"error: {message}"), r.stderr
    png = tmp_path / "a.png"
    shown = run_json(cli, "inspect", art.key, "--png", png)
    assert shown["png"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    r = cli("inspect", art.key, "--png", png)
    assert r.returncode == 2 and "already exists" in r.stderr
    from structinit.analysis.figures import check_output

    assert check_output(png, force=True) == png  # --force lets it be replaced (without drawing it twice here)
    listing = run_json(cli, "inspect")
    mine = [e for e in listing["artifacts"] if e.get("key") == art.key]
    assert listing["cache_dir"] == str(cache_dir) and len(mine) == 1 and mine[0]["ok"] is True
    assert mine[0]["hit_rate"] == art.stats["summary"]["hit_rate"]
    assert mine[0]["target_mass"] == art.stats["summary"]["target_mass"] and mine[0]["config"] == art.config.describe()
    text = cli("inspect").stdout
    s = art.stats["summary"]
    assert (f"{art.key}  {art.config.describe()}  hit {s['hit_rate']:.3f}  mass {s['target_mass']:.3f}  "
            f"{art.path}") in text
    assert text.startswith(f"user cache: {cache_dir} (then the shipped artifacts)")
    bad = cache_dir / "n16-d16-h2-f3-ffffffffffff.safetensors"
    bad.write_bytes(b"\x00" * 40)
    listing = run_json(cli, "inspect")
    broken = [e for e in listing["artifacts"] if e["path"] == str(bad)]
    assert broken and broken[0]["ok"] is False and "not a readable safetensors file" in broken[0]["error"]
    assert re.search(r"^CORRUPT\s+.*ffffffffffff", cli("inspect").stdout, re.M)


def test_inspect_checkpoint_numbers_are_the_checkpoints(cli, tmp_path):
    src = vit_file(tmp_path)
    rep = run_json(cli, "apply", src, "--heads", HEADS, "--data-fit", "0", "--target-mass", "0.35")
    desc = describe_checkpoint(rep["output"], heads=HEADS)
    shown = run_json(cli, "inspect", rep["output"], "--heads", HEADS)
    through = shown.pop("on_inputs")  # the model's measure beside (test_inspect_checkpoint)
    assert shown.pop("on_inputs_skipped") is None and len(through["layers"]) == len(desc["layers"])
    assert shown == json.loads(json.dumps(desc))
    for row, applied in zip(shown["layers"], rep["layers"]):
        assert row["offsets"] == applied["offsets"] and row["target_mass"] == pytest.approx(0.35, abs=1e-3)
    text = cli("inspect", rep["output"], "--heads", HEADS).stdout
    assert (f"grid 4x4 (16 tokens), dim {DIM}, heads {HEADS}, depth 2, prefix tokens 1, position embedding: "
            "sincos") in text
    for row in desc["layers"]:
        offs = " ".join(f"({dy:+d},{dx:+d})" for dy, dx in row["offsets"])
        m = re.search(rf"^\s+{row['layer']}\s+(\S+)\s+(\S+)\s+(\S+)\s+{re.escape(offs)}$", text, re.M)
        assert m, (row, text)
        assert float(m.group(1)) == pytest.approx(row["hit_rate"], abs=5e-4)
        assert float(m.group(2)) == pytest.approx(row["target_mass"], abs=5e-4)
        assert float(m.group(3)) == pytest.approx(row["mse"], rel=5e-3)


def test_every_registered_method_is_named_in_the_help_of_each_command_that_takes_one(cli):
    """The method lists of --method and --init are read from the registry (apply listed 4 of 6)."""
    from structinit.init.registry import INIT_METHODS

    for command in (["apply"], ["train"], ["inspect"]):
        text = " ".join(cli(*command, "--help").stdout.split())
        for name in INIT_METHODS:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (command, name)
