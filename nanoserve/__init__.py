"""nanoserve: an offline batch-inference engine for Llama-architecture models.

The engine as one object is `nanoserve.llm.LLM`; sampling settings are
`nanoserve.sampling.SamplingParams`. Nothing in this package imports Ray.
"""

__version__ = "0.1.0"
