"""Stage preparation: a row read becomes a request. Its prompt column is found, its chat or
text rendered and tokenized, its images gathered, its sampling values checked (or it
becomes an error row that never reaches the engine); a static engine's rows are cut into
batches by length. The result columns a request's answer fills (`result_columns`) are
set here too, below the workers that fill them.

Imports only the input stage (tests/test_layering.py).
"""
