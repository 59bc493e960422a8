"""Experiments: the paper's comparison as grids of training runs. A grid (a TOML file, :mod:`.gridspec`)
expands into runs named by their key (:mod:`.expand`); launchers run them on this machine, as a
SLURM job array or as printed commands (:mod:`.launch`, :mod:`.slurm`), each run through one task
(:mod:`.task`); :mod:`.status` says where a grid stands, and :mod:`.report`, :mod:`.plots`,
:mod:`.attention` and :mod:`.output` turn what has finished into tables, CSV, JSON and figures."""
