"""Stage workers: a row on the worker that holds the engine. A shard's walk (`ShardRunner`:
read, prepare, run, assemble, write its part), the engine per process (`BatchWorker`),
what a task plugs into the walk and into the driver (`TaskKind`, `TaskPlan`), and the
job's options as the workers get them (`JobOptions`).

Imports only the stages before it (tests/test_layering.py).
"""
