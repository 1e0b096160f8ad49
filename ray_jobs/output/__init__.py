"""Stage output: where a row's result is recorded. The output folder's manifest (the job's
settings, the shards committed, completion), the part names a worker writes its shard's
results under, and the parts adopted on resume.

Below the workers, which write their parts under its names; imports only the stages
before it (tests/test_layering.py).
"""
