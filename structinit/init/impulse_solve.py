"""The plain solve of an impulse spec for a target: the :class:`~structinit.solver.config.SolveConfig`
a target's shape gives (:func:`solve_config`), the artifact solved or read (:func:`artifact_for`),
and the check that the target's position embedding is the one the solve is for
(:func:`check_pos_embed`). The sin-cos table, unless ``fit_pe`` solves for the target's own
embedding or ``artifact`` names one solved for it."""

from __future__ import annotations

from structinit.errors import UsageError, param


def solve_config(spec, grid, dim: int, heads: int, depth: int, seed: int = 0, embedding=None):
    """The :class:`~structinit.solver.config.SolveConfig` for a model of this shape (fitted to
    position ``embedding [N, D]`` when given)."""
    from structinit.solver.config import SolveConfig, embedding_digest

    params = dict(spec.recipe_params)
    if spec.target_mass is not None:
        params["target_mass"] = spec.target_mass
    return SolveConfig(grid=grid, dim=dim, heads=heads, filter=spec.filter, layers=depth, share=spec.share,
                       recipe=spec.recipe, params=params, pseudo_input=spec.pseudo_input,
                       pseudo_input_rest=spec.pseudo_input_rest, padding=spec.padding,
                       offset_order=spec.offset_order, seed=seed, causal=spec.causal,
                       pos_embed=embedding_digest(embedding) if embedding is not None else None)

def artifact_for(spec, t, seed: int = 0, cache_dir=None, device: str = "cpu", progress=None):
    """``(artifact, cached)`` for target ``t``: the given one (``cached`` ``None``) or solved
    (for ``t``'s own position embedding with ``fit_pe``). Raises :class:`UsageError` when the
    artifact was solved for another position embedding than the one ``t`` has (see the class
    docstring)."""
    from structinit.solver.cache import resolve_artifact
    from structinit.solver.run import solve

    if spec.artifact is not None:
        art, cached = resolve_artifact(spec.artifact, cache_dir), None
    else:
        embedding = None
        if spec.fit_pe or spec.position_subspace:  # the embedding it has, or the subspace's table just written
            embedding = t.pos_embed()
            if embedding is None:
                raise UsageError(f"impulse parameter {param('fit_pe')}: the {t.layout} target has no position "
                                 "embedding to fit")
        config = solve_config(spec, t.grid, t.dim, t.heads, t.depth, seed, embedding)  # refuses bad settings
        if embedding is None:
            check_pos_embed(spec, t)
        result = solve(config, cache_dir=cache_dir, device=device, progress=progress, embedding=embedding)
        art, cached = result.artifact, result.cached
    check_pos_embed(spec, t, art)
    return art, cached

def check_pos_embed(spec, t, art=None) -> None:
    """Raise :class:`UsageError` when target ``t``'s position embedding is not the one the
    solve is for: ``art``'s (a fitted one must be ``t``'s own), or the sin-cos table."""
    from structinit.solver.config import embedding_digest

    kind = t.pos_embed_kind()
    if kind is None or (art is None and (spec.fit_pe or spec.artifact is not None or spec.position_subspace)):
        return  # fit_pe solves for it, a given artifact is checked when read, the subspace writes its own table
    fitted = art.config.pos_embed if art is not None else None
    if fitted is not None:
        if embedding_digest(t.pos_embed()) != fitted:
            raise UsageError(f"the {param('artifact')} was solved for another position embedding than the "
                             f"target's {t.pos_key}; solve again with {param('fit_pe')}")
        return
    uses_pe = (art.config.pseudo_input if art is not None else spec.pseudo_input).startswith("pe")
    if kind == "other" and uses_pe:
        raise UsageError(
            f"the target's position embedding {t.pos_key} is not the sin-cos table the impulse solve assumes "
            f"(a learned one?), so Q/K solved on the table would not give impulse attention on it; give "
            f"{param('fit_pe')} to solve for the embedding it has, or write the sin-cos table first "
            f"({param('set_pe')} sincos for a checkpoint, {param('pe_scale')} for a model)")


__all__ = ["solve_config", "artifact_for", "check_pos_embed"]
