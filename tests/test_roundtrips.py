"""Every artifact variant through the file and back: each field equal after save and reload, the
reloaded Q/K giving exactly the quality the file states, and every way a file can be wrong refused
with a message that says what is wrong."""

import hashlib
import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save

from structinit.analysis.quality import MEASURES, Quality, measure
from structinit.errors import ArtifactError
from structinit.geometry.embedding import pseudo_input
from structinit.geometry.targets import draw_offsets, impulse_columns
from structinit.solver.artifact import Artifact, _checksum, _header_checksum, read_artifact, write_artifact
from structinit.solver.config import SolveConfig
from structinit.solver.run import layer_inputs, solve

SMALL = dict(grid=(6, 6), dim=32, heads=4)

#: One of every kind of artifact: depth, sharing, a second pseudo input, padding, offset order,
#: seed, recipes, a sequence and a non-square grid, a larger filter.
VARIANTS = {
    "two-layers": SolveConfig(**SMALL, layers=2),
    "shared-with-rest-circular": SolveConfig(**SMALL, layers=3, share=True, pseudo_input_rest="uniform",
                                             padding="circular"),
    "rest-not-shared-centre": SolveConfig(**SMALL, layers=2, pseudo_input="pe+gaussian",
                                          pseudo_input_rest="gaussian", offset_order="centre", seed=3),
    "shared-one-input": SolveConfig(**SMALL, layers=3, share=True, params={"target_mass": 0.6}),
    "sequence": SolveConfig(grid=(12,), dim=16, heads=2, layers=2),
    "non-square-closed-form": SolveConfig(grid=(4, 6), dim=32, heads=4, recipe="closed-form",
                                          params={"qk_scale": 12.0}),
    "paper": SolveConfig(**SMALL, recipe="paper", params={"iters": 30, "lr": 1e-2}),
    "released": SolveConfig(**SMALL, layers=2, recipe="released", params={"iters": 30, "lr": 1e-2, "norm_every": 7}),
    "filter-5-pe+uniform": SolveConfig(**SMALL, filter=5, pseudo_input="pe+uniform", seed=2),
}


def assert_same_artifact(a: Artifact, b: Artifact):
    """Every field equal, arrays bit for bit with the same dtype."""
    assert a.config == b.config and a.key == b.key and a.config.canonical_json() == b.config.canonical_json()
    for name in ("q", "k", "offsets", "pseudo_input"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    if a.pseudo_input_rest is None:
        assert b.pseudo_input_rest is None
    else:
        assert b.pseudo_input_rest.dtype == np.float32 and np.array_equal(a.pseudo_input_rest, b.pseudo_input_rest)
    assert json.loads(json.dumps(a.stats)) == b.stats
    assert a.version == b.version


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_survives_the_file_field_by_field(name, tmp_path):
    cfg = VARIANTS[name]
    made = solve(cfg, cache_dir=tmp_path)
    art = made.artifact
    assert not made.cached and art.path == tmp_path / cfg.filename and art.config is cfg
    L, H, D, d = cfg.layers, cfg.heads, cfg.dim, cfg.head_dim
    assert art.q.shape == art.k.shape == (L, H, D, d) and art.q.dtype == art.k.dtype == np.float32
    assert art.offsets.shape == (L, H, 2) and art.offsets.dtype == np.int32
    reread = read_artifact(art.path)
    assert reread.path == art.path
    assert_same_artifact(art, reread)
    hit = solve(cfg, cache_dir=tmp_path)  # the cache hit is the same artifact
    assert hit.cached and hit.artifact.path == art.path
    assert_same_artifact(art, hit.artifact)
    # What the file holds, by name: the second pseudo input only when there is one.
    with safe_open(str(art.path), "np") as fh:
        names, meta = set(fh.keys()), fh.metadata()
    assert names == {"q", "k", "offsets", "pseudo_input"} | ({"pseudo_input_rest"} if cfg.pseudo_input_rest else set())
    assert meta["config"] == cfg.canonical_json() and meta["format"] == "structinit/1"
    assert meta["key"] == hashlib.sha256(meta["config"].encode()).hexdigest()[:12] == cfg.key
    assert json.loads(meta["stats"]) == reread.stats


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reloaded_weights_give_the_stored_quality(name, tmp_path):
    cfg = VARIANTS[name]
    art = read_artifact(solve(cfg, cache_dir=tmp_path).artifact.path)
    stored = art.quality
    assert stored.layers == cfg.layers and stored.mse.shape == (cfg.layers, cfg.heads)
    for layer in range(cfg.layers):
        cols = impulse_columns(cfg.grid, art.offsets[layer], cfg.padding)
        got = measure(art.layer_input(layer), art.q[layer], art.k[layer], cols)
        for m in MEASURES:
            np.testing.assert_allclose(getattr(got, m)[0], getattr(stored, m)[layer], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name}: layer {layer} {m}")
    summary = art.stats["summary"]
    assert set(summary) == set(MEASURES)
    for m in MEASURES:
        assert summary[m] == pytest.approx(float(getattr(stored, m).mean()), rel=1e-9)
    assert art.stats["device"] == "cpu" and art.stats["seconds"] > 0
    assert Quality.from_stats(stored.to_stats()).summary() == stored.summary()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_layer_was_solved_on_its_pseudo_input_with_its_offsets(name, tmp_path):
    cfg = VARIANTS[name]
    art = solve(cfg, cache_dir=tmp_path).artifact
    first = pseudo_input(cfg.pseudo_input, cfg.grid, cfg.dim, seed=cfg.seed)
    assert np.array_equal(art.pseudo_input, first)
    if cfg.pseudo_input_rest is None:
        assert art.pseudo_input_rest is None
        assert all(art.layer_input(l) is art.pseudo_input for l in range(cfg.layers))
    else:
        rest = pseudo_input(cfg.pseudo_input_rest, cfg.grid, cfg.dim, seed=cfg.seed + 1)
        assert np.array_equal(art.pseudo_input_rest, rest) and not np.array_equal(rest, first)
        assert art.layer_input(0) is art.pseudo_input
        assert all(art.layer_input(l) is art.pseudo_input_rest for l in range(1, cfg.layers))
    solved = cfg.layers if not cfg.share else (2 if cfg.pseudo_input_rest and cfg.layers > 1 else 1)
    drawn = draw_offsets(cfg.filter, cfg.heads, solved, cfg.seed, cfg.offset_order, ndim=cfg.grid.ndim,
                         causal=cfg.causal)
    for l in range(cfg.layers):
        src = min(l, solved - 1)
        assert np.array_equal(art.offsets[l], drawn[src]), l
        assert np.array_equal(art.q[l], art.q[src]) and np.array_equal(art.k[l], art.k[src])
    if solved == cfg.layers and cfg.layers > 1 and cfg.offset_order == "random":
        assert not np.array_equal(art.q[0], art.q[1])  # not shared: every layer its own solve


def test_layer_inputs_seeds_the_second_input_apart():
    cfg = VARIANTS["rest-not-shared-centre"]
    first, rest = layer_inputs(cfg)
    assert np.array_equal(first, pseudo_input("pe+gaussian", cfg.grid, cfg.dim, seed=3))
    assert np.array_equal(rest, pseudo_input("gaussian", cfg.grid, cfg.dim, seed=4))
    assert layer_inputs(VARIANTS["two-layers"])[1] is None


def test_artifact_tensors_and_quality_accessors():
    cfg = SolveConfig(grid=(4, 4), dim=16, heads=2, layers=2)
    q = np.arange(2 * 2 * 16 * 8, dtype=np.float32).reshape(2, 2, 16, 8)
    x, r = np.ones((16, 16), np.float32), np.zeros((16, 16), np.float32)
    art = Artifact(config=cfg, q=q[:, :, :, ::-1], k=q, offsets=np.zeros((2, 2, 2), np.int32), pseudo_input=x,
                   stats={"layers": [[{m: float(10 * l + h) for m in MEASURES} for h in range(2)] for l in range(2)]})
    t = art.tensors()
    assert set(t) == {"q", "k", "offsets", "pseudo_input"} and all(v.flags.c_contiguous for v in t.values())
    assert np.array_equal(t["q"], art.q)
    art.pseudo_input_rest = r
    assert set(art.tensors()) == {"q", "k", "offsets", "pseudo_input", "pseudo_input_rest"}
    assert art.layer_input(0) is x and art.layer_input(1) is r
    assert art.quality.target_mass.tolist() == [[0.0, 1.0], [10.0, 11.0]]
    assert art.key == cfg.key


# --------------------------------------------------------------------------- files that are wrong

def _rewrite(path, tensors=None, meta=None, fix_checksum=True):
    """Rewrite artifact ``path`` with some tensors or metadata replaced (``None`` values drop an entry)."""
    with safe_open(str(path), "np") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}
        m = dict(fh.metadata())
    for k, v in (tensors or {}).items():
        t.pop(k) if v is None else t.__setitem__(k, v)
    for k, v in (meta or {}).items():
        m.pop(k) if v is None else m.__setitem__(k, v)
    if fix_checksum:  # a consistent file, as another writer would make it
        m["checksum"] = _checksum(t)
        if "header_checksum" in m:
            m["header_checksum"] = _header_checksum(m)
    path.write_bytes(save(t, metadata=m))


@pytest.fixture
def artifact_file(tmp_path):
    return solve(SolveConfig(grid=(4, 4), dim=16, heads=2, layers=2), cache_dir=tmp_path).artifact.path


def test_wrong_format_is_refused(artifact_file):
    _rewrite(artifact_file, meta={"format": "other/2"})
    with pytest.raises(ArtifactError, match=r"not a structinit artifact \(format 'other/2', expected 'structinit/1'\)"):
        read_artifact(artifact_file)
    _rewrite(artifact_file, meta={"format": None})
    with pytest.raises(ArtifactError, match="format None"):
        read_artifact(artifact_file)


def test_key_that_does_not_match_the_config_is_refused(artifact_file):
    cfg = SolveConfig(grid=(4, 4), dim=16, heads=2, layers=2)
    _rewrite(artifact_file, meta={"key": "0123456789ab"})
    with pytest.raises(ArtifactError, match=f"key '0123456789ab' does not match its config \\(expected {cfg.key}\\)"):
        read_artifact(artifact_file)
    # a config edited without its key: the key no longer matches
    other = SolveConfig(grid=(4, 4), dim=16, heads=2, layers=2, seed=1)
    _rewrite(artifact_file, meta={"config": other.canonical_json(), "key": cfg.key})
    with pytest.raises(ArtifactError, match="does not match its config"):
        read_artifact(artifact_file)


def test_checksum_catches_changed_data(artifact_file):
    with safe_open(str(artifact_file), "np") as fh:
        q = fh.get_tensor("q")
    q[0, 0, 0, 0] += 1.0
    _rewrite(artifact_file, tensors={"q": q}, fix_checksum=False)
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        read_artifact(artifact_file)
    _rewrite(artifact_file, meta={"checksum": None}, fix_checksum=False)
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        read_artifact(artifact_file)


def test_an_edited_header_is_caught_and_an_older_artifact_without_its_checksum_read(artifact_file):
    with safe_open(str(artifact_file), "np") as fh:
        stats = json.loads(fh.metadata()["stats"])
    stats["layers"][0][0]["hit_rate"] = 0.123  # a hand-edited quality figure
    _rewrite(artifact_file, meta={"stats": json.dumps(stats, sort_keys=True)}, fix_checksum=False)
    with pytest.raises(ArtifactError, match="header checksum mismatch"):
        read_artifact(artifact_file)
    _rewrite(artifact_file, meta={"header_checksum": None}, fix_checksum=False)  # as 0.2 wrote it
    assert read_artifact(artifact_file).stats["layers"][0][0]["hit_rate"] == 0.123


def test_checksum_covers_names_dtypes_and_shapes():
    a = {"q": np.zeros((2, 3), np.float32)}
    assert _checksum(a) == _checksum({"q": np.zeros((2, 3), np.float32)})
    assert _checksum(a) != _checksum({"k": np.zeros((2, 3), np.float32)})
    assert _checksum(a) != _checksum({"q": np.zeros((3, 2), np.float32)})
    assert _checksum(a) != _checksum({"q": np.zeros((2, 3), np.int32)})
    assert _checksum({"a": a["q"], "b": a["q"][:1]}) == _checksum({"b": a["q"][:1], "a": a["q"]})  # order-free


@pytest.mark.parametrize("missing", ["q", "k", "offsets", "pseudo_input"])
def test_missing_tensor_is_named(artifact_file, missing):
    _rewrite(artifact_file, tensors={missing: None})
    with pytest.raises(ArtifactError, match=rf"missing tensors \['{missing}'\]"):
        read_artifact(artifact_file)


@pytest.mark.parametrize("name, shape, expect", [
    ("q", (2, 2, 16, 4), "(2, 2, 16, 8)"), ("k", (1, 2, 16, 8), "(2, 2, 16, 8)"),
    ("offsets", (2, 2, 3), "(2, 2, 2)"), ("pseudo_input", (16, 8), "(16, 16)"),
])
def test_tensor_of_the_wrong_shape_is_named(artifact_file, name, shape, expect):
    dtype = np.int32 if name == "offsets" else np.float32
    _rewrite(artifact_file, tensors={name: np.zeros(shape, dtype)})
    with pytest.raises(ArtifactError, match=rf"tensor {name} has shape {re_escape(str(shape))}, expected "
                                            rf"{re_escape(expect)}"):
        read_artifact(artifact_file)


def re_escape(text):
    import re

    return re.escape(text)


@pytest.mark.parametrize("meta", [{"config": "{not json"}, {"stats": "[1,"}, {"config": json.dumps({"grid": [4]})},
                                  {"config": None}])
def test_corrupt_metadata_is_refused(artifact_file, meta):
    _rewrite(artifact_file, meta=meta)
    with pytest.raises(ArtifactError, match="corrupt metadata"):
        read_artifact(artifact_file)


def test_unreadable_paths(tmp_path, artifact_file):
    with pytest.raises(ArtifactError, match="no such file"):
        read_artifact(tmp_path / "gone.safetensors")
    with pytest.raises(ArtifactError, match="a folder, not a regular file"):
        read_artifact(tmp_path)
    raw = artifact_file.read_bytes()
    artifact_file.write_bytes((10 ** 9).to_bytes(8, "little") + raw[8:])  # header longer than the file
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        read_artifact(artifact_file)
    artifact_file.write_bytes(raw[:5])
    with pytest.raises(ArtifactError, match="truncated or corrupt"):
        read_artifact(artifact_file)


def test_write_failure_is_an_artifact_error_and_leaves_nothing(tmp_path):
    """A full disk (here: a file-size limit) while writing an artifact is one clear error, and
    neither the artifact nor its temp file is left behind."""
    import resource
    import signal

    cfg = SolveConfig(grid=(8, 8), dim=32, heads=4)
    art = solve(cfg, cache_dir=tmp_path / "a").artifact
    out = tmp_path / "b" / cfg.filename
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(ArtifactError, match=r"cannot write \(File too large\)"):
            write_artifact(art, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert list(out.parent.iterdir()) == []


def test_metadata_layout_and_files_from_other_writers(tmp_path, artifact_file):
    art = read_artifact(artifact_file)
    with safe_open(str(artifact_file), "np") as fh:
        meta = fh.metadata()
    assert meta["stats"] == json.dumps(art.stats, sort_keys=True)  # sorted: the same stats, the same bytes
    nested = write_artifact(art, tmp_path / "new" / "deeper" / "x.safetensors")  # folders are created
    assert read_artifact(nested).key == art.key
    _rewrite(artifact_file, meta={"version": None})  # written by a tool that does not record its version
    assert read_artifact(artifact_file).version == "?"
