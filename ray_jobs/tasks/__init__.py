"""Stage tasks: what the engine makes of a row. Generation (a completion per row,
`ray_jobs.tasks.generate`) and embedding (a vector per row, `ray_jobs.tasks.embed`): each
task's preparer, its plug-in of the shard walk, its actor class and its plan of the job.

Imports only the stages before it; neither task imports the other (tests/test_layering.py).
"""
