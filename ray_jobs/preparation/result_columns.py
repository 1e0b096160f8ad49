"""Stage preparation: the result columns, what every output row gets after its input's columns.

`RESULT_SCHEMA`: the text, tokens, counts, finish reason and error of a row; `CONTROL_SCHEMA`:
the output-control columns after them, each in a job's output only where a row may ask for
it (`result_schema(controls)`, chosen by `ray_jobs.preparation.prepare.output_controls`);
`WORKER_RESULT_SCHEMA`: both, the table a worker returns (`ray_jobs.workers.worker`).

Invariants: the result columns come in this order, after `id` and the input's own columns
(an input column of one of these names is refused by `prepare`); a worker's table always
has every column, the job's output only the controls it can need.
"""

from __future__ import annotations

import pyarrow as pa

# The columns every output row gets after `id` and the input's own columns.
RESULT_SCHEMA = pa.schema([
    ("generated_text", pa.string()),
    ("generated_token_ids", pa.list_(pa.int32())),
    ("num_input_tokens", pa.int64()),
    ("num_generated_tokens", pa.int64()),
    ("finish_reason", pa.string()),  # 'stop', 'length' or 'error'
    ("error", pa.string()),  # null unless the row failed
])
RESULT_COLUMNS = tuple(RESULT_SCHEMA.names)

# Generated or prompt tokens' logprobs (`nanoserve.sampling.logprobs.TokenLogprob.as_dict`): per token
# its id, logprob (of the model's raw logits), rank (1: the most likely) and the `top` k most
# likely tokens there, most likely first.
LOGPROB_TOP_TYPE = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32()),
                                    ("rank", pa.int32()), ("top", pa.list_(LOGPROB_TOP_TYPE))]))
# The output-control columns, after RESULT_SCHEMA's, each present only when the job can need
# it: `sample_index` when a row may ask for n > 1 samples (one output row per sample),
# `logprobs` / `prompt_logprobs` when a row may ask for them. A worker's table always has all.
CONTROL_SCHEMA = pa.schema([
    ("sample_index", pa.int32()),  # which of the row's n samples (0..n-1)
    ("logprobs", LOGPROBS_TYPE),  # one per generated token; null unless asked
    ("prompt_logprobs", LOGPROBS_TYPE),  # one per prompt token after the first; null unless asked
    # {label: probability} of a row that asked for choice scores; null otherwise
    ("choice_scores", pa.map_(pa.string(), pa.float64())),
    # with a reasoning parser: the think block's text (null where none) and its tokens;
    # generated_text is then the answer only
    ("reasoning", pa.string()),
    ("num_reasoning_tokens", pa.int64()),
])
CONTROL_COLUMNS = tuple(CONTROL_SCHEMA.names)
WORKER_RESULT_SCHEMA = pa.schema(list(RESULT_SCHEMA) + list(CONTROL_SCHEMA))


def result_schema(controls: tuple[str, ...] = ()) -> pa.Schema:
    """RESULT_SCHEMA followed by the output-control columns named in `controls`, in
    CONTROL_SCHEMA's order."""
    return pa.schema(list(RESULT_SCHEMA) + [f for f in CONTROL_SCHEMA if f.name in controls])
