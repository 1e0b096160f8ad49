"""Stage tasks: what the engine makes of a row. Generation (a completion per row,
`ray_jobs.tasks.generate`), embedding (a vector per row, `ray_jobs.tasks.embed`),
classification and cross-encoder scores (an encoder's head per text or pair,
`ray_jobs.tasks.classify`): each
task's preparer, its plug-in of the shard walk, its actor class and its plan of the job.

Imports only the stages before it; no task module imports another (tests/test_layering.py).
"""
