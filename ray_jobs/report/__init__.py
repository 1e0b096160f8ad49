"""Stage report: what a row's run adds to the job's account. The job's phases and their
lengths (`Timeline`), and the HTML report of its running totals and time bins.

Imports only the stages before it (tests/test_layering.py).
"""
