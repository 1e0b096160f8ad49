"""Benchmarks: scripts that print a table. Run them as modules from the repository root,
e.g. `python -m benchmarks.kernels`.
Results go in `benchmarks/RESULTS.md`."""
