"""Token grids (1-D and 2-D), impulse targets, fixed sin-cos position embeddings and the pseudo inputs solved on."""
