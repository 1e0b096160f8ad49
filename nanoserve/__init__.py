"""nanoserve: an offline batch-inference engine for Llama-architecture models.

The engine as one object is `LLM` (`nanoserve.llm`); sampling settings are
`SamplingParams`. Nothing in this package imports Ray.

The public API is `__all__` below, one name per line with the module it comes from: what
the batch job (`ray_jobs`) and the command line (`nanoserve_cli`) use of the engine, and
nothing else (`tests/test_layering.py` holds them to it). It is, besides the errors and
the settings' types:
- the engine: `LLM` (load a model; `generate`, `chat`, `choice_scores`, `embed`), and on
  it what a batch worker needs: `start_loop()` (a continuous engine's running batch: submit
  rows from any thread, stream their results, counters), `row_fit` (does a row fit the KV
  pool alone), `label_token_ids` / `score_labels` (label probabilities), `reasoning_parser`
  (the parser it resolved and applies to its completions: the job never splits a think
  block itself);
- the model's files: `resolve_model`, `ModelConfig`, `Tokenizer`, `validate_checkpoint`,
  `check_lora_adapters` (LoRA adapter folders checked against a model, torch-free),
  `ChatTemplate`, `ImageConfig`, the grammar spec `StructuredOutputs`, the embedding
  settings `PoolingConfig` and `Embedder`; classifiers (an encoder or a decoder with a
  sequence-classification head, a causal LM as a reranker): `load_classifier`,
  `read_classifier` (its config and tokenizer, no weights), and the encoders' `Encoder`;
- a few pure helpers the job's driver needs before any engine exists (option checks,
  `choose_reasoning_parser`, `byte_level_bytes`).

Names resolve lazily (PEP 562 `__getattr__`): `import nanoserve` imports neither torch
nor any engine module; `from nanoserve import LLM` imports what `LLM` needs.

Importing the package sets OMP_WAIT_POLICY=PASSIVE unless the environment sets a policy, so
that torch's CPU threads, once nanoserve imports it, sleep rather than spin between
operations (`nanoserve.cpu_threads`).
"""

from nanoserve.cpu_threads import prefer_passive_wait

prefer_passive_wait()

__version__ = "0.1.0"

# name -> (module, attribute there)
_PUBLIC = {
    # errors
    "NanoserveError": ("nanoserve.errors", "NanoserveError"),
    "InputError": ("nanoserve.errors", "InputError"),
    "ModelError": ("nanoserve.errors", "ModelError"),
    "check_positive_int": ("nanoserve.errors", "check_positive_int"),
    "first_line": ("nanoserve.errors", "first_line"),
    # the engine, its requests and results
    "LLM": ("nanoserve.llm", "LLM"),
    "Completion": ("nanoserve.llm", "Completion"),
    "RowFit": ("nanoserve.llm", "RowFit"),
    "BatchStats": ("nanoserve.static.generate", "BatchStats"),
    "SamplingParams": ("nanoserve.sampling.params", "SamplingParams"),
    "MAX_N": ("nanoserve.sampling.params", "MAX_N"),
    "MultimodalPrompt": ("nanoserve.multimodal.prompt", "MultimodalPrompt"),
    "chat_prompt": ("nanoserve.multimodal.prompt", "chat_prompt"),
    "CPU_DEFAULT_ROWS": ("nanoserve.scheduling.running_rows", "CPU_DEFAULT_ROWS"),
    "MAX_DEFAULT_ROWS": ("nanoserve.scheduling.running_rows", "MAX_DEFAULT_ROWS"),
    "check_online": ("nanoserve.model.quantization", "check_online"),
    "token_budget": ("nanoserve.sampling.params", "token_budget"),
    "check_room": ("nanoserve.sampling.params", "check_room"),
    # the options every entry point shares, declared once
    "Option": ("nanoserve.options", "Option"),
    "ENGINE": ("nanoserve.options", "ENGINE"),
    "SAMPLING": ("nanoserve.options", "SAMPLING"),
    "STRUCTURED": ("nanoserve.options", "STRUCTURED"),
    "add_option": ("nanoserve.options", "add_option"),
    # the model's files
    "DEFAULT_MODEL": ("nanoserve.options", "DEFAULT_MODEL"),
    "check_model_name": ("nanoserve.weights.model_store", "check_model_name"),
    "resolve_model": ("nanoserve.weights.model_store", "resolve_model"),
    "ModelConfig": ("nanoserve.model.config", "ModelConfig"),
    "validate_checkpoint": ("nanoserve.weights.weights", "validate_checkpoint"),
    "check_lora_adapters": ("nanoserve.weights.lora_weights", "check_lora_adapters"),
    "Tokenizer": ("nanoserve.weights.tokenizer", "Tokenizer"),
    "byte_level_bytes": ("nanoserve.weights.tokenizer", "byte_level_bytes"),
    "ChatTemplate": ("nanoserve.weights.chat_template", "ChatTemplate"),
    "template_kwargs": ("nanoserve.weights.chat_template", "template_kwargs"),
    "ImageConfig": ("nanoserve.multimodal.image_input", "ImageConfig"),
    # structured outputs and label scores
    "StructuredOutputs": ("nanoserve.sampling.structured", "StructuredOutputs"),
    "GrammarCache": ("nanoserve.sampling.structured", "GrammarCache"),
    "structured_from_request": ("nanoserve.sampling.structured", "structured_from_request"),
    "check_labels": ("nanoserve.sampling.structured", "check_labels"),
    # reasoning
    "REASONING_PARSER_CHOICES": ("nanoserve.sampling.reasoning", "CHOICES"),
    "choose_reasoning_parser": ("nanoserve.sampling.reasoning", "choose_reasoning_parser"),
    # embeddings
    "Embedder": ("nanoserve.embed", "Embedder"),
    "PoolingConfig": ("nanoserve.embed", "PoolingConfig"),
    "resolve_pooling": ("nanoserve.embed", "resolve_pooling"),
    "with_instruction": ("nanoserve.embed", "with_instruction"),
    # classifiers (encoders, decoders, rerankers): classification and pair scores
    "Encoder": ("nanoserve.encoder.api", "Encoder"),
    "load_classifier": ("nanoserve.classify", "load_classifier"),
    "read_classifier": ("nanoserve.classify", "read_classifier"),
    # the engine's command line (`nanoserve generate|chat|...`), which the job's joins
    "ENGINE_COMMANDS": ("nanoserve.cli", "ENGINE_COMMANDS"),
    "LIST_FLAGS": ("nanoserve.cli", "LIST_FLAGS"),
    "SuggestingParser": ("nanoserve.cli", "SuggestingParser"),
    "add_engine_parsers": ("nanoserve.cli", "add_engine_parsers"),
    "run_command": ("nanoserve.cli", "run_command"),
}

__all__ = [
    "NanoserveError", "InputError", "ModelError", "check_positive_int", "first_line",
    "LLM", "Completion", "RowFit", "BatchStats", "SamplingParams", "MAX_N",
    "MultimodalPrompt", "chat_prompt", "CPU_DEFAULT_ROWS", "MAX_DEFAULT_ROWS", "check_online",
    "token_budget", "check_room", "Option", "ENGINE", "SAMPLING", "STRUCTURED", "add_option",
    "DEFAULT_MODEL", "check_model_name", "resolve_model", "ModelConfig", "validate_checkpoint",
    "check_lora_adapters",
    "Tokenizer", "byte_level_bytes", "ChatTemplate", "template_kwargs", "ImageConfig",
    "StructuredOutputs", "GrammarCache", "structured_from_request", "check_labels",
    "REASONING_PARSER_CHOICES", "choose_reasoning_parser",
    "Embedder", "PoolingConfig", "resolve_pooling", "with_instruction",
    "Encoder", "load_classifier", "read_classifier",
    "ENGINE_COMMANDS", "LIST_FLAGS", "SuggestingParser", "add_engine_parsers", "run_command",
]


def __getattr__(name: str):  # PEP 562: a public name, imported at its first use
    if name not in _PUBLIC:
        raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
    import importlib

    module, attr = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
