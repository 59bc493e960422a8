"""The safetensors artifact of one solve and its validation.

Tensors: ``q``, ``k`` float32 ``[layers, heads, D, d]``; ``offsets`` int32 ``[layers, heads, 2]``
as ``(dy, dx)``; ``pseudo_input`` float32 ``[N, D]`` (first layer) and, when the following layers
use another one, ``pseudo_input_rest`` float32 ``[N, D]``.
Metadata (strings): ``format`` (``structinit/1``), ``config`` (canonical JSON), ``key``,
``stats`` (JSON), ``version``, ``checksum`` (SHA-256 of the tensor bytes, so that a flipped byte
is caught, not only a truncated file) and ``header_checksum`` (SHA-256 of the other metadata, so
that an edited header is caught; artifacts written before it was added have none, and are read
without it, except fitted ones).

A *fitted* artifact (the impulse data fit's result, :mod:`structinit.fit.artifact`) has one more
metadata entry, ``fit`` (JSON): what the Q/K were fitted to (``identity``: the plain solve's key,
digests of the model weights and of the batch the fit read, the fit's parameters and algorithm
version) and what it measured. Its key is the hash of ``identity`` (:func:`fit_key`), not of the
config (the plain solve's); its Q/K and offsets have one entry per model layer (``identity``'s
``depth``), whatever the solve shared. Its ``stats`` measure the fitted Q/K on the pseudo input.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np

from structinit import __version__
from structinit.atomic import NotRegularFile, atomic_write, read_regular
from structinit.errors import ArtifactError, ArtifactNotFound
from structinit.keys import json_key
from structinit.solver.config import FORMAT, SolveConfig

if TYPE_CHECKING:
    from structinit.analysis.quality import Quality


@dataclass
class Artifact:
    """A solved Q/K set. Arrays are NumPy; ``q, k: [layers, heads, D, d]``."""

    config: SolveConfig
    q: np.ndarray
    k: np.ndarray
    offsets: np.ndarray
    pseudo_input: np.ndarray
    stats: Dict[str, Any]
    pseudo_input_rest: Optional[np.ndarray] = None
    path: Optional[Path] = None
    version: str = __version__
    fit: Optional[Dict[str, Any]] = None

    @property
    def key(self) -> str:
        """The config's key, or for a fitted artifact the key of what it was fitted to."""
        return fit_key(self.fit["identity"]) if self.fit else self.config.key

    @property
    def depth(self) -> int:
        """Layers of Q/K held (1 for a solve shared by every layer)."""
        return int(self.q.shape[0])

    @property
    def filename(self) -> str:
        """The config's file name; a fitted artifact's is ``n{N}-d{D}-h{heads}-f{f}-fit-{key}.safetensors``."""
        return fit_filename(self.config, self.key) if self.fit else self.config.filename

    def tensors(self) -> Dict[str, np.ndarray]:
        out = {"q": self.q, "k": self.k, "offsets": self.offsets, "pseudo_input": self.pseudo_input}
        if self.pseudo_input_rest is not None:
            out["pseudo_input_rest"] = self.pseudo_input_rest
        return {name: np.ascontiguousarray(t) for name, t in out.items()}

    @property
    def quality(self) -> Quality:
        """The solver's :class:`~structinit.analysis.quality.Quality` record (from ``stats``)."""
        from structinit.analysis.quality import Quality

        return Quality.from_stats(self.stats["layers"])

    def layer_input(self, layer: int) -> np.ndarray:
        """The pseudo input ``[N, D]`` that layer ``layer`` was solved on."""
        if layer > 0 and self.pseudo_input_rest is not None:
            return self.pseudo_input_rest
        return self.pseudo_input


def fit_filename(config: SolveConfig, key: str) -> str:
    """A fitted artifact's file name: ``n{N}-d{D}-h{heads}-f{f}-fit-{key}.safetensors`` (the grid as
    the plain solve of ``config`` names it)."""
    c = config
    return f"{c.grid.label}-d{c.dim}-h{c.heads}-f{c.filter}-fit-{key}.safetensors"


def fit_key(identity: Dict[str, Any]) -> str:
    """The key (:mod:`structinit.keys`) of a fitted artifact's canonical ``identity`` JSON."""
    return json_key(identity)


def _checksum(tensors: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype.str}:{list(t.shape)};".encode())
        h.update(t.tobytes())
    return h.hexdigest()


def _header_checksum(meta: Dict[str, str]) -> str:
    """SHA-256 of every metadata entry but this checksum itself (sorted JSON), so that an edited
    header (a stats or fit entry changed by hand) is caught, not only edited tensors."""
    rest = {k: v for k, v in meta.items() if k != "header_checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def nonfinite_tensors(tensors: Dict[str, np.ndarray]) -> str:
    """``""`` when every value of ``tensors`` is finite, else which tensors hold how many that are
    not, in words (``"q: 8,192 of 65,536"``)."""
    bad = []
    for name, t in tensors.items():
        arr = np.asarray(t)
        if arr.dtype.kind in "fc":
            count = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            if count:
                bad.append(f"{name}: {count:,} of {arr.size:,}")
    return "; ".join(bad)


def write_artifact(artifact: Artifact, path: Path) -> Path:
    """Write ``artifact`` to ``path`` atomically (temp file in the same folder, fsync, ``os.replace``).

    A failed write (a full disk, a missing permission) raises :class:`ArtifactError` and leaves
    neither ``path`` nor a temp file behind."""
    from safetensors.numpy import save

    path = Path(path)
    tensors = artifact.tensors()
    bad = nonfinite_tensors(tensors)
    if bad:
        raise ArtifactError(f"{path}: not written: its tensors hold values that are not finite ({bad})")
    meta = {
        "format": FORMAT,
        "config": artifact.config.canonical_json(),
        "key": artifact.key,
        "stats": json.dumps(artifact.stats, sort_keys=True),
        "version": artifact.version,
        "checksum": _checksum(tensors),
    }
    if artifact.fit:
        meta["fit"] = json.dumps(artifact.fit, sort_keys=True)
    meta["header_checksum"] = _header_checksum(meta)
    data = save(tensors, metadata=meta)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as fh:
            fh.write(data)
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot write ({exc.strerror or exc})") from None
    return path


def read_artifact(path: Path) -> Artifact:
    """Load and fully validate an artifact; raises :class:`ArtifactError` saying what is wrong."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    path = Path(path)
    try:
        raw = read_regular(path, check=_size_check)
    except FileNotFoundError:
        raise ArtifactNotFound(f"{path}: no such file") from None
    except NotRegularFile as exc:
        raise (ArtifactError if exc.errno == errno.EFBIG else ArtifactNotFound)(f"{path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ArtifactError(f"{path}: not a readable safetensors file (truncated or corrupt: {exc})") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        tensors = load(raw)
        meta = _metadata(raw)
    except (SafetensorError, ValueError, OverflowError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not a readable safetensors file (truncated or corrupt: {exc})") from None
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a structinit artifact (format {meta.get('format')!r}, expected {FORMAT!r})")
    try:
        config = SolveConfig.from_dict(json.loads(meta["config"]))
        stats = json.loads(meta["stats"])
        fit = json.loads(meta["fit"]) if "fit" in meta else None
        want = fit_key(fit["identity"]) if fit is not None else config.key
        depth = int(fit["identity"]["depth"]) if fit is not None else config.layers
    except Exception as exc:  # noqa: BLE001 - any malformed metadata is a corrupt artifact
        raise ArtifactError(f"{path}: corrupt metadata ({exc})") from None
    if meta.get("key") != want:
        what = "what it was fitted to" if fit is not None else "its config"
        raise ArtifactError(f"{path}: key {meta.get('key')!r} does not match {what} (expected {want})")
    if meta.get("checksum") != _checksum(tensors):
        raise ArtifactError(f"{path}: checksum mismatch (the tensor data is corrupt)")
    if "header_checksum" in meta or fit is not None:  # written since 0.3; a fitted artifact must have it
        if meta.get("header_checksum") != _header_checksum(meta):
            raise ArtifactError(f"{path}: header checksum mismatch (its metadata was edited or is corrupt)")
    missing = [n for n in ("q", "k", "offsets", "pseudo_input") if n not in tensors]
    if missing:
        raise ArtifactError(f"{path}: missing tensors {missing}")
    L, H, D, d = depth, config.heads, config.dim, config.head_dim
    expect = {"q": (L, H, D, d), "k": (L, H, D, d), "offsets": (L, H, 2), "pseudo_input": (config.tokens, D)}
    for name, shape in expect.items():
        if tuple(tensors[name].shape) != shape:
            raise ArtifactError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    bad = nonfinite_tensors(tensors)
    if bad:
        raise ArtifactError(f"{path}: its tensors hold values that are not finite ({bad}): a solve or fit that "
                            "diverged, not one to use")
    return Artifact(config=config, q=tensors["q"], k=tensors["k"], offsets=tensors["offsets"],
                    pseudo_input=tensors["pseudo_input"], pseudo_input_rest=tensors.get("pseudo_input_rest"),
                    stats=stats, path=path, version=meta.get("version", "?"), fit=fit)


#: The largest safetensors header read (safetensors' own limit): a longer one is not an artifact's.
MAX_HEADER = 100_000_000


def _size_check(fh: IO[bytes], size: int) -> None:
    """Refuse (``ValueError``), before its tensors are read, a file whose header promises another
    size than it has, or tensors larger than an artifact of its config holds: what is read is then
    what the file's header says, and never more than its config needs."""
    head = fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or n > size - 8 or n > MAX_HEADER:
        raise ValueError(f"a {size}-byte file whose first bytes promise a header of {n} bytes")
    try:
        header = json.loads(fh.read(n).decode("utf-8"))
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
        meta = header.get("__metadata__") or {}
        config = SolveConfig.from_dict(json.loads(meta["config"]))
        depth = int(json.loads(meta["fit"])["identity"]["depth"]) if "fit" in meta else config.layers
    except Exception:  # noqa: BLE001 - not what an artifact's header holds: the full read says what is wrong
        return
    end = max(ends, default=0)
    if 8 + n + end != size:
        raise ValueError(f"its header's tensors end at byte {8 + n + end}, the file has {size}")
    c = config
    most = 4 * (2 * depth * c.heads * c.dim * c.head_dim + 2 * depth * c.heads + 2 * c.tokens * c.dim)
    if end > most:
        raise ValueError(f"its tensors take {end} bytes; an artifact of its config holds at most {most}")


#: How far the target mass an artifact's Q/K give on its own pseudo input may lie from the one its
#: stats record (a solve on a GPU, measured there, differs from a CPU measure by about 1e-6).
STATS_TOLERANCE = 1e-3


def target_mass(x: np.ndarray, q: np.ndarray, k: np.ndarray, columns: np.ndarray,
                mask: Optional[np.ndarray] = None) -> float:
    """The mean over heads of :func:`head_target_masses`."""
    return float(np.mean(head_target_masses(x, q, k, columns, mask)))


def head_target_masses(x: np.ndarray, q: np.ndarray, k: np.ndarray, columns: np.ndarray,
                       mask: Optional[np.ndarray] = None) -> List[float]:
    """Per head, the attention ``softmax(x q_h (x k_h)^T / sqrt(d))`` on each row's target column
    (rows with a target only), as :func:`structinit.analysis.quality.measure` gives it, in NumPy (a
    cache hit imports no torch), row chunk by row chunk. ``x: [N, D]``, ``q, k: [H, D, d]``,
    ``columns: [H, N]``, ``mask``: bool ``[N, N]`` or ``None``."""
    n = x.shape[0]
    step = max(1, min(n, 2 ** 22 // max(n, 1)))
    masses = []
    for h in range(q.shape[0]):
        xq = x.astype(np.float32) @ q[h].astype(np.float32)
        xk = x.astype(np.float32) @ k[h].astype(np.float32)
        cols = np.asarray(columns[h])
        on = 0.0
        for a in range(0, n, step):
            logits = (xq[a:a + step] @ xk.T) / np.float32(math.sqrt(q.shape[-1]))
            if mask is not None:
                logits = np.where(mask[a:a + step], logits, -np.inf)
            logits = logits - logits.max(axis=-1, keepdims=True)
            attn = np.exp(logits)
            attn /= attn.sum(axis=-1, keepdims=True)
            c = cols[a:a + step]
            rows = np.nonzero(c >= 0)[0]
            on += float(attn[rows, c[rows]].astype(np.float64).sum())
        masses.append(on / max(int((cols >= 0).sum()), 1))
    return masses


def check_stats(art: Artifact) -> None:
    """Raise :class:`ArtifactError` unless ``art``'s Q/K give, on its own pseudo input, the target
    mass its ``stats`` record for every head of every layer (within :data:`STATS_TOLERANCE`): one
    head scaled, or two heads swapped, is caught, not only a change of a layer's mean.

    The checksums say that a file is as it was written, not that a solve or a fit wrote it: Q/K
    scaled by hand with both checksums made again pass them. Such an artifact would be written into
    a model and then fail the write's own check with a message about the layout; measured here,
    before it is used, it is named for what it is."""
    from structinit.geometry.targets import causal_mask, impulse_columns

    c = art.config
    recorded = art.stats.get("layers") if isinstance(art.stats, dict) else None
    if not isinstance(recorded, list) or len(recorded) != art.depth:
        raise ArtifactError(f"{art.path}: its stats record {len(recorded) if isinstance(recorded, list) else 'no'} "
                            f"layer(s), its Q/K hold {art.depth}")
    mask = causal_mask(c.grid, c.causal)
    for layer in range(art.depth):
        try:
            wants = [float(head["target_mass"]) for head in recorded[layer]]
        except (TypeError, KeyError, ValueError):
            raise ArtifactError(f"{art.path}: its stats of layer {layer} hold no target mass per head") from None
        if len(wants) != c.heads:
            raise ArtifactError(f"{art.path}: its stats of layer {layer} record {len(wants)} head(s), its Q/K hold "
                                f"{c.heads}")
        columns = impulse_columns(c.grid, art.offsets[layer], c.padding)
        # a fit of a one-layer solve measured every layer on that layer's input (fit.artifact.run_fit)
        x = art.layer_input(0 if c.layers == 1 else layer)
        gots = head_target_masses(x, art.q[layer], art.k[layer], columns, mask)
        for head, (got, want) in enumerate(zip(gots, wants)):
            if not abs(got - want) <= STATS_TOLERANCE:
                raise ArtifactError(f"{art.path}: its Q/K give head {head} of layer {layer} a target mass of {got:.3f} "
                                    f"on its own pseudo input, and its stats record {want:.3f}: the tensors are not "
                                    "the ones that were solved (edited, with its checksums made again)")


def _metadata(raw: bytes) -> Dict[str, str]:
    """The ``__metadata__`` map of a safetensors byte string."""
    if len(raw) < 8:
        raise ValueError("file shorter than the safetensors header")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise ValueError("header longer than the file")
    return json.loads(raw[8:8 + n].decode("utf-8")).get("__metadata__", {}) or {}
