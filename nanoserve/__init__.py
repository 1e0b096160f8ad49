"""nanoserve: an offline batch-inference engine for Llama-architecture models.

The engine as one object is `nanoserve.llm.LLM`; sampling settings are
`nanoserve.sampling.SamplingParams`. Nothing in this package imports Ray.

Importing the package sets OMP_WAIT_POLICY=PASSIVE unless the environment sets a policy, so
that torch's CPU threads, once nanoserve imports it, sleep rather than spin between
operations (`nanoserve.cpu_threads`).
"""

from nanoserve.cpu_threads import prefer_passive_wait

prefer_passive_wait()

__version__ = "0.1.0"
