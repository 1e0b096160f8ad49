"""Stage input: where a row comes from. The driver lists and scans the input (files,
schema, row counts, ids) and cuts it into shards; a worker reads its own shard's rows
(Parquet, JSON Lines, OpenAI request lines) from a local path or an object store.

The first stage: it imports no other stage of the job (tests/test_layering.py).
"""
