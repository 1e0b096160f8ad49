"""Benchmarks: scripts that print a table. Run them as modules from the repository root,
e.g. `python -m benchmarks.kernels`, so the top-level `kernels` package is the engine's
(a script run by path would put this folder, with its `kernels.py`, first on sys.path).
Results go in `benchmarks/RESULTS.md`."""
