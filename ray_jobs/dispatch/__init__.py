"""Stage dispatch: the driver moves a row's shard, never the row. It joins or starts Ray,
starts and replaces the workers (the actor pool, growing as GPUs join), hands out shard
descriptors, records the shards whose parts are written, and resumes.

The last stage: it may import every stage before it (tests/test_layering.py).
"""
