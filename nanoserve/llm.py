"""`LLM`: the engine as one object. Loads a model and its tokenizer, owns one KV block
pool, and generates for lists of prompts: with the continuous scheduler by default (on a
GPU and on the CPU), or in static batches that fit that pool.

    llm = LLM()                                   # the default model, CPU or GPU
    outs = llm.generate([llm.tokenizer.encode("Hello")], [SamplingParams(max_tokens=8)])

    llm = LLM(model, lora={"sql": "adapters/sql"})  # LoRA adapters (PEFT folders), by name
    outs = llm.generate(prompts, params, lora=["sql", None, ...])  # per prompt; None: base
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nanoserve.cache.kv_cache_dtype import read_kv_scales, resolve_kv_cache_dtype
from nanoserve.cache.pool import CacheShape, KVPool
from nanoserve.cpu_threads import configure_torch_threads
from nanoserve.errors import CacheFullError, NanoserveError, check_positive_int
from nanoserve.model.config import ModelConfig
from nanoserve.multimodal.image_input import ImageConfig
from nanoserve.multimodal.prompt import MultimodalPrompt, chat_prompt
from nanoserve.options import ENGINE
from nanoserve.sampling.params import SamplingParams, token_budget
from nanoserve.sampling.reasoning import resolve_parser, split_completions
from nanoserve.sampling.sequence import SequenceOutput as Completion
from nanoserve.sampling.structured import GrammarCache
from nanoserve.scheduling.lora_slots import AdapterSlots, build_adapter_slots
from nanoserve.scheduling.model_runner import ContinuousRunner
from nanoserve.scheduling.running_rows import CPU_DEFAULT_ROWS, default_max_rows
from nanoserve.scheduling.scheduler import generate_continuous
from nanoserve.static.cuda_graph import MIN_DECODE_STEPS, graphs_wanted
from nanoserve.static.generate import (
    DECODE_STEP_MODES,
    BatchStats,
    blocks_for_batch,
    generate_batch,
)
from nanoserve.weights.dummy_weights import random_model
from nanoserve.weights.fp8 import build_with_fp8, check_quantization
from nanoserve.weights.model_store import keep_kernels_with_models, resolve_model
from nanoserve.weights.tokenizer import Tokenizer
from nanoserve.weights.weights import load_checkpoint
from nanoserve_kernels.kv_quant import is_fp8

if TYPE_CHECKING:
    from nanoserve.scheduling.engine_loop import EngineLoop

__all__ = ["LLM", "SCHEDULERS", "Completion", "RowFit", "resolve_device", "resolve_dtype"]

SCHEDULERS = ENGINE["scheduler"].choices

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 1 << 30  # a CPU pool of 1 GiB unless told otherwise


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on a GPU and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if problem := ENGINE["dtype"].problem(dtype):
        raise NanoserveError(problem)
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model: str = ENGINE["model"].default,
                 dtype: str | torch.dtype = ENGINE["dtype"].default, device: str = "auto",
                 kv_cache_fraction: float = ENGINE["kv_cache_fraction"].default_for("LLM"),
                 kv_cache_bytes: int | None = ENGINE["kv_cache_bytes"].default,
                 block_size: int = 16,
                 max_batch_size: int | None = ENGINE["max_running_rows"].default,
                 decode_step: str = "auto", scheduler: str = ENGINE["scheduler"].default,
                 enable_prefix_caching: bool = ENGINE["prefix_caching"].default,
                 quantization: str | None = ENGINE["quantization"].default,
                 load_format: str = "auto",
                 kv_cache_dtype: str = ENGINE["kv_cache_dtype"].default,
                 reasoning_parser: str | None = ENGINE["reasoning_parser"].default,
                 num_threads: int | None = None,
                 lora: Mapping[str, str | Path] | Sequence[str] = ENGINE["lora"].default,
                 max_loras: int | None = None) -> None:
        """The defaults of the options `nanoserve.options.ENGINE` declares are its (the
        KV share is `LLM`'s own override there), and so are their checks.
        kv_cache_fraction: share of the GPU's free memory (after the weights) given to
        the KV pool. kv_cache_bytes: an exact pool size instead (the CPU default is 1 GiB).
        decode_step: "auto" (a CUDA graph per batch on a GPU, see nanoserve/static/cuda_graph.py),
        "eager", "static" or "graph": how decode steps run (the tokens are the same). With
        the continuous scheduler "auto"/"graph" capture one graph per batch-size bucket and
        one per prefill length and kind here, at load (nanoserve/scheduling/model_runner.py).
        scheduler: "static" (the prompts cut into static batches, each run to its longest
        row), "continuous" (rows join as others finish: nanoserve/scheduling/scheduler.py) or "auto"
        (continuous, on the CPU too: a static batch computes every row until its longest
        is done). Each row gets the tokens it gets alone either way (held to that by the
        tests).
        enable_prefix_caching: with the continuous scheduler, a prompt's leading full blocks
        that the pool already holds (an earlier row's same prefix) are reused, not
        prefilled again (nanoserve/cache/prefix_cache.py), with either scheduler (a static batch
        finds the blocks earlier batches on the pool named); a model with a sliding window
        too (a cache hit's prefill attends through the pool within the window).
        quantization: "fp8" quantizes a checkpoint's projections to FP8 e4m3 at load (a GPU
        of compute capability 8.9+ only; refused elsewhere). FP8 checkpoints need no flag:
        FP8 GEMMs on such a GPU, dequantized weights elsewhere (nanoserve/weights/fp8.py).
        load_format: "auto" reads the checkpoint; "dummy" reads only its config.json and
        tokenizer and draws random weights on the device (nanoserve/weights/dummy_weights.py: for
        benchmarks of shapes whose checkpoint does not fit the disk).
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" (float8 e4m3 with per-layer scales
        from the checkpoint, else 1.0: twice the tokens in the same memory; a GPU of compute
        capability 8.9 or newer only; see nanoserve/cache/kv_cache_dtype.py).
        reasoning_parser: "qwen3" or "deepseek_r1" (vLLM's names), "auto" (picked from the
        model family where certain: `nanoserve.sampling.reasoning.pick_parser`; `reasoning_line` says
        which) or "none"/None. Under one, a completion's `reasoning` is its think block and
        `text` the answer alone; a structured output applies from the answer's start; and
        `SamplingParams.max_thinking_tokens` bounds the block (nanoserve/sampling/reasoning.py).
        max_batch_size: the most rows decoding at once (and the largest captured step). Rows
        beyond it wait; fewer run when the pool runs out of blocks. None: on a GPU with the
        continuous scheduler, as many as the pool holds at 512 tokens a row, within 256 to
        1,024 (`nanoserve.scheduling.running_rows`: 1,024 for an 8B model on an H200,
        where a step of 1,024 rows shares the weights' read and its GEMMs are compute-bound);
        elsewhere 256. An FP8 cache holds twice the tokens (benchmarks/RESULTS.md).
        num_threads: on the CPU, torch's intra-op threads (default: the cores this process
        may run on; `nanoserve.cpu_threads`, the set-up every entry point shares).
        lora: LoRA adapters, {name: PEFT folder} or "NAME=PATH" strings, read into host
        memory here (a folder that cannot be used: ModelError naming the field); a prompt
        picks one by name (`generate(..., lora=...)`), in any mix within a batch: the base
        GEMMs run once for all rows, each row's low-rank update after them
        (nanoserve/model/lora.py). Continuous scheduler only. max_loras: adapters on the
        device at once (default: one slot per adapter, at most 8); more are swapped in on
        demand, the least recently used idle one out (nanoserve/scheduling/lora_slots.py)."""
        if max_batch_size is not None:
            check_positive_int(max_batch_size, "max_batch_size (the most rows running at once)")
        self.enable_prefix_caching = enable_prefix_caching
        if problem := ENGINE["scheduler"].problem(scheduler):
            raise NanoserveError(problem)
        self.scheduler = scheduler
        if decode_step not in DECODE_STEP_MODES:
            raise NanoserveError(f"decode_step must be one of {', '.join(DECODE_STEP_MODES)}, "
                                 f"got {decode_step!r}")
        self.decode_step = decode_step
        t0 = time.perf_counter()
        self.model_path = resolve_model(model)
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            keep_kernels_with_models()
        else:
            configure_torch_threads(num_threads)
        self.dtype = resolve_dtype(dtype, self.device)
        check_quantization(quantization, self.device)  # before reading any weights
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype, self.device)
        if load_format == "dummy":
            config = ModelConfig.from_json_file(self.model_path / "config.json")
            self.model = random_model(config, self.dtype, self.device, quantization)
        elif load_format == "auto":
            config, state_dict = load_checkpoint(self.model_path)
            self.model = build_with_fp8(config, state_dict, self.dtype, self.device,
                                        quantization)
            del state_dict
        else:
            raise NanoserveError(f"load_format must be auto or dummy, got {load_format!r}")
        t1 = time.perf_counter()
        self.tokenizer = Tokenizer.from_path(self.model_path)
        self.config = config
        # a vision-language model's image processor settings (preprocessor_config.json)
        self.image_config = (ImageConfig.from_folder(self.model_path)
                             if config.vision is not None else None)
        self.eos_token_ids = tuple(sorted(set(config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        # Structured outputs: xgrammar's view of this tokenizer, built at the first
        # constrained row; each constraint compiled once.
        self.grammars = GrammarCache(self.tokenizer, config.vocab_size, self.eos_token_ids)
        try:
            self.reasoning, self.reasoning_line = resolve_parser(
                reasoning_parser, config.architecture, self.tokenizer)
        except ValueError as e:
            raise NanoserveError(str(e)) from None
        self.grammars.reasoning = self.reasoning
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free * kv_cache_fraction)
            else:
                kv_cache_bytes = CPU_KV_CACHE_BYTES
        scales = (None, None)
        if is_fp8(self.kv_cache_dtype):  # the checkpoint's scales, else 1.0
            scales = read_kv_scales(self.model_path, config.num_hidden_layers)[:2]
        t2 = time.perf_counter()
        self.pool = KVPool.for_memory(CacheShape.of(config), kv_cache_bytes, block_size,
                                      self.kv_cache_dtype, self.device, *scales)
        t3 = time.perf_counter()
        self.last_stats = BatchStats()
        if scheduler == "auto":
            self.scheduler = "continuous"  # on the CPU too: rows leave as they finish
        if max_batch_size is None:
            max_batch_size = (default_max_rows(self.pool.num_tokens, self.device.type == "cuda")
                              if self.scheduler == "continuous" else CPU_DEFAULT_ROWS)
        self.max_batch_size = max_batch_size
        if lora and self.scheduler != "continuous":
            raise NanoserveError("LoRA adapters run on the continuous scheduler only "
                                 "(scheduler 'auto' or 'continuous')")
        self.adapters = build_adapter_slots(config, lora, max_loras, self.dtype, self.device)
        self.runner: ContinuousRunner | None = None
        if self.scheduler == "continuous":
            self.runner = ContinuousRunner(self.model, self.pool, max_batch_size,
                                           continuous_step_mode(decode_step, self.device),
                                           adapters=self.adapters)
            # Every prefill length's graph now, not in the first run (a first 1,024-row run
            # of the 1B shape was 0.85x the second with them captured as met: 1.00x so).
            self.runner.capture_prefills()
        # Seconds each part of the load took (what a job's fixed cost is made of).
        self.load_timings = {"weights_s": t1 - t0, "tokenizer_s": t2 - t1, "kv_pool_s": t3 - t2,
                             "runner_s": time.perf_counter() - t3}

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The names of this engine's LoRA adapters (`lora` at load), in their order."""
        return self.adapters.names if self.adapters is not None else ()

    def generate(self, prompt_token_ids: list[list[int]] | list[str] | list[MultimodalPrompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[Completion]:
        """One completion per sample, in prompt order (a prompt is a list of token ids, a
        text encoded with the tokenizer's BOS rule, or a `MultimodalPrompt`: token ids with
        images, as `chat` makes them; continuous scheduler only): a prompt whose params ask for n
        samples gives n consecutive completions (`sample_index` 0..n-1). Static scheduler: prompts are cut into
        static batches that fit the pool at their peak; a batch the device cannot hold is
        halved and retried. Continuous scheduler: one continuous batch over all prompts
        (capped at max_batch_size running rows); if the device runs out of memory there, the
        call is run again the static way (not with LoRA adapters: the error is raised).
        lora: each prompt's LoRA adapter by name (None: the base model), or one name for all;
        NanoserveError for a name the engine was not given."""
        if isinstance(prompt_token_ids, str):
            raise TypeError("generate takes a list of prompts: wrap a single text in a list")
        prompt_token_ids = [self.tokenizer.encode(p) if isinstance(p, str) else p
                            for p in prompt_token_ids]
        with_images = any(isinstance(p, MultimodalPrompt) for p in prompt_token_ids)
        if with_images and self.scheduler != "continuous":
            raise NanoserveError("prompts with images run on the continuous scheduler only")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompt_token_ids)
        if len(params) != len(prompt_token_ids):
            raise ValueError("one SamplingParams per prompt, or one for all")
        if isinstance(lora, str):
            lora = [lora] * len(prompt_token_ids)
        try:
            lora = (self.adapters or AdapterSlots.empty()).check_names(lora, len(params))
        except ValueError as e:
            raise NanoserveError(str(e)) from None
        self.last_stats = BatchStats()
        if self.scheduler == "continuous" and prompt_token_ids:
            try:
                outs, stats = generate_continuous(
                    self.model, prompt_token_ids, params, self.eos_token_ids, self.pool,
                    self.tokenizer, self.max_batch_size, runner=self.runner,
                    prefix_caching=self.enable_prefix_caching, grammars=self.grammars,
                    lora=lora)
            except torch.OutOfMemoryError:
                if with_images or any(lora):
                    raise
                torch.cuda.empty_cache()  # below: static batches, halved until they fit
            else:
                self.last_stats = stats
                return split_completions(self.reasoning, prompt_token_ids, params, outs)
        out: list[Completion] = []
        for batch in self._plan(prompt_token_ids, params):
            out.extend(self._run(prompt_token_ids, params, batch))
        return split_completions(self.reasoning, prompt_token_ids, params, out)

    @property
    def reasoning_parser(self) -> str | None:
        """The name of the reasoning parser this engine runs (None: no split)."""
        return self.reasoning.name if self.reasoning is not None else None

    def start_loop(self) -> EngineLoop:
        """A new `nanoserve.scheduling.engine_loop.EngineLoop` over this engine (continuous scheduler
        only, else ValueError): one running batch that rows are submitted to from any thread,
        their results streamed back as futures (`progress()` while they run), its counters,
        and work run between two steps (`call`). Its completions are split by the reasoning
        parser like `generate`'s. Invariant: while it runs, this LLM's `generate` must not
        be called, and `score_labels` runs only through its `call`."""
        from nanoserve.scheduling.engine_loop import EngineLoop

        return EngineLoop(self)

    def row_fit(self, prompt: Sequence[int], params: SamplingParams, together: int = 1
                ) -> RowFit:
        """Whether `together` samples of `prompt`, run alone, fit the KV pool at their peak
        (prompt + the steps `generate` runs: max_tokens, capped by the context)."""
        steps = self._max_new(prompt, params)
        need = blocks_for_batch([len(prompt)] * together, steps, self.pool.block_size)
        return RowFit(need, steps, self.pool.block_size, self.pool.num_blocks)

    def label_token_ids(self, labels: Sequence[str], prompt: Sequence[int] = ()
                        ) -> list[list[int]]:
        """Each label's token ids, encoded alone without special tokens. ValueError (one
        line) for an empty list, an empty label or one given twice, or when `prompt` and
        its longest label do not fit the model's context."""
        from nanoserve.sampling.choice_scores import check_fits, label_token_ids

        ids = label_token_ids(self.tokenizer, labels)
        check_fits(prompt, ids, self.max_context)
        return ids

    def score_labels(self, prompts: list[list[int]], label_ids: list[list[list[int]]]
                     ) -> list[list[float]]:
        """Per prompt, its labels' probabilities (`label_ids[i]`: prompt i's labels' token
        ids, from `label_token_ids`), normalised over them: forward passes over the labels
        on this engine's model and pool (`nanoserve.sampling.choice_scores`). Not beside another
        call on the engine: under a running `start_loop`, through its `call`."""
        from nanoserve.sampling.choice_scores import label_logprobs, normalise

        return [normalise(s) for s in label_logprobs(self.model, self.pool, prompts, label_ids)]

    def chat(self, conversations: list[list[dict]] | list[dict],
             params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template_kwargs: dict | None = None,
             lora: str | Sequence[str | None] | None = None) -> list[Completion]:
        """`generate` over conversations (one list of {role, content} messages, or a list of
        them), each rendered with the model's chat template (generation prompt added; the
        template writes the special tokens). `chat_template_kwargs` become template
        variables, e.g. `{"enable_thinking": False}` (plain data, never code; ValueError
        for a non-object or a variable the renderer owns).
        A vision-language model (Qwen2.5-VL) takes OpenAI content parts too: a message's
        content may be a list of {"type": "text", "text": ...}, {"type": "image_url",
        "image_url": {"url": data: URL, local path or file:// URL}} and {"type": "image",
        "image": path or bytes}; an image that cannot be used raises ImageError
        (nanoserve/multimodal/image_input.py). lora: as `generate`'s."""
        from nanoserve.weights.chat_template import template_kwargs

        kwargs = template_kwargs(chat_template_kwargs)
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        if self.image_config is not None:
            prompts = [chat_prompt(self.tokenizer, self.config.image_token_id,
                                   self.image_config, c, **kwargs) for c in conversations]
            return self.generate(prompts, params, lora)
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, **kwargs),
            add_special_tokens=False) for c in conversations]
        return self.generate(prompts, params, lora)

    def choice_scores(self, prompts: list[list[int]] | list[str],
                      labels: list[str]) -> list[dict[str, float]]:
        """One {label: probability} per prompt: the model's probability of each whole label
        after the prompt, normalised over the labels (`nanoserve.sampling.choice_scores`). A prompt is
        token ids or a text (encoded with the tokenizer's BOS rule). ValueError for an
        empty label list or a label given twice."""
        from nanoserve.sampling.choice_scores import choice_scores

        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        return choice_scores(self, prompts, labels)

    def _max_new(self, prompt: list[int], p: SamplingParams) -> int:
        """The prompt's generation budget (`token_budget`; ValueError when the prompt
        fills the context)."""
        return token_budget(p.max_tokens, len(prompt), self.max_context)

    def _plan(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Consecutive rows grouped while the batch fits the pool and max_batch_size."""
        batches: list[list[int]] = []
        cur: list[int] = []
        bs, total = self.pool.block_size, self.pool.num_blocks
        def lens(rows: list[int]) -> list[int]:  # one per sample
            return [len(prompts[j]) for j in rows for _ in range(params[j].n)]

        for i in range(len(prompts)):
            trial = cur + [i]
            steps = max(self._max_new(prompts[j], params[j]) for j in trial)
            need = blocks_for_batch(lens(trial), steps, bs)
            if cur and (need > total or len(lens(trial)) > self.max_batch_size):
                batches.append(cur)
                trial = [i]
                steps = self._max_new(prompts[i], params[i])
                need = blocks_for_batch(lens(trial), steps, bs)
            if need > total:
                raise CacheFullError(
                    f"prompt {i} ({len(prompts[i])} tokens + {steps} new) needs {need} KV blocks; "
                    f"the pool has {total}: give the cache more memory or ask for fewer tokens"
                )
            cur = trial
        if cur:
            batches.append(cur)
        return batches

    def _run(self, prompts, params, batch: list[int]) -> list[Completion]:
        try:
            outs, stats = generate_batch(
                self.model, [prompts[i] for i in batch], [params[i] for i in batch],
                self.eos_token_ids, self.pool, self.tokenizer, self.decode_step,
                self.enable_prefix_caching, self.grammars,
            )
        except torch.OutOfMemoryError:
            if len(batch) == 1:
                raise
            torch.cuda.empty_cache()
            half = len(batch) // 2
            return self._run(prompts, params, batch[:half]) + self._run(prompts, params, batch[half:])
        self.last_stats.add(stats)
        return outs

    def embed(self, inputs: list[str] | list[list[int]], *, pooling: str | None = None,
              normalize: bool | None = None, dimensions: int | None = None,
              instruction: str | None = None, max_input_tokens: int | None = None,
              max_batch_tokens: int = 16384) -> torch.Tensor:
        """One pooled vector per text (or token id list): [len(inputs), dim] float32 on the
        CPU. Prefill only, rows packed, no KV kept; settings not given come from the model
        folder's sentence-transformers files, else last-token pooling, normalised
        (nanoserve/embed.py)."""
        from nanoserve.embed import Embedder, resolve_pooling

        cfg = resolve_pooling(self.model_path, self.config.hidden_size, self.max_context,
                              pooling=pooling, normalize=normalize, dimensions=dimensions,
                              instruction=instruction, max_input_tokens=max_input_tokens)
        return Embedder(self.model, self.tokenizer, cfg, max_batch_tokens).embed(inputs)


@dataclass(frozen=True)
class RowFit:
    """A row's KV need against the pool (`LLM.row_fit`): `blocks` of `block_size` tokens for
    `steps` new tokens; the pool holds `pool_blocks`."""

    blocks: int
    steps: int
    block_size: int
    pool_blocks: int

    @property
    def fits(self) -> bool:
        return self.blocks <= self.pool_blocks


def continuous_step_mode(decode_step: str, device: torch.device) -> str:
    """The continuous runner's step mode for LLM's decode_step: "auto" captures graphs
    where `graphs_wanted` allows it (CUDA, Triton kernels, not turned off), else eager."""
    if decode_step == "auto":
        return "graph" if graphs_wanted(device, MIN_DECODE_STEPS) else "eager"
    return decode_step
