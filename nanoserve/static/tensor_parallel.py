"""Tensor-parallel generation on N local processes (torch.distributed, gloo on the CPU).

`run_tensor_parallel(fn, N, *args)` spawns N processes (torch.multiprocessing, spawn),
joins them in one process group and calls fn(tp, *args) on each; rank 0's return value
comes back. `generate_tensor_parallel` runs the static greedy path that way: every rank
loads the checkpoint, keeps its shard (nanoserve/model/parallel.py: the sharding and where
its collectives are) and runs `greedy_generate_batch` over its shard.

The step, per rank: rank 0 owns the schedule. Every rank runs the same static loop over
the same prompts, but the step's token ids and positions are broadcast from rank 0 at the
top of each forward (the decoder's pre-hook), so the tokens every rank feeds are the ones
rank 0 sampled; the block tables, sequence lengths and attention metadata follow from
those inputs by the same deterministic code on every rank (each rank's KV pool holds only
its own KV heads, with the same blocks in the same places). After the logits' all-gather
every rank holds the full logits; rank 0's greedy choice is the one that goes on.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanoserve.model.parallel import TensorParallel, shard_model
from nanoserve.static.generate import greedy_generate_batch
from nanoserve.weights.weights import load_checkpoint


def _rank_main(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple,
               result_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        out = fn(TensorParallel(rank, world_size), *args)
        if rank == 0:  # a file, not a pipe: a large result would block until read
            Path(result_file).write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_tensor_parallel(fn: Callable, world_size: int, *args: Any) -> Any:
    """fn(tp, *args) on `world_size` spawned processes (gloo); rank 0's result. fn and
    args must pickle (fn a module-level function); its result is JSON (lists, numbers,
    strings; tuples come back as lists): rank 0 writes it to a file in a temporary folder of
    this call's own, read back here (JSON, not pickle: nothing here unpickles). A failing rank
    fails the call."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="nanoserve-tp-") as tmp:
        init_file, result_file = str(Path(tmp) / "rendezvous"), Path(tmp) / "result.json"
        mp.spawn(_rank_main, args=(world_size, init_file, fn, args, str(result_file)),
                 nprocs=world_size, join=True)
        return json.loads(result_file.read_text())


def _load_shard(tp: TensorParallel, checkpoint: str, dtype: torch.dtype):
    config, state_dict = load_checkpoint(checkpoint)
    return shard_model(config, state_dict, tp, dtype)


def _generate_rank(tp: TensorParallel, checkpoint: str, prompts: list[list[int]],
                   max_new_tokens: int, eos_token_ids: tuple[int, ...],
                   dtype: torch.dtype) -> list[list[int]]:
    model = _load_shard(tp, checkpoint, dtype)
    return greedy_generate_batch(model, prompts, max_new_tokens, eos_token_ids)


def generate_tensor_parallel(checkpoint: str | Path, prompts: list[list[int]],
                             max_new_tokens: int, world_size: int,
                             eos_token_ids: tuple[int, ...] = (),
                             dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy tokens of a static batch, the model split over `world_size` CPU processes."""
    return run_tensor_parallel(_generate_rank, world_size, str(checkpoint), prompts,
                               max_new_tokens, tuple(eos_token_ids), dtype)


def _logits_rank(tp: TensorParallel, checkpoint: str, ids: list[int],
                 dtype: torch.dtype) -> list[list[float]]:
    from nanoserve.cache.pool import CacheShape, DenseKVCache
    from nanoserve.model.attention import AttentionMetadata

    model = _load_shard(tp, checkpoint, dtype)
    cache = DenseKVCache(CacheShape.of(model.config), len(ids), dtype=dtype, device="cpu")
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache,
                       AttentionMetadata.prefill())
    return logits[0].tolist()


def tensor_parallel_logits(checkpoint: str | Path, ids: list[int], world_size: int,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A prefill's logits [T, V] (float32), the model split over `world_size` processes
    and its head's slices all-gathered: the sharded forward's check against one rank."""
    return torch.tensor(run_tensor_parallel(_logits_rank, world_size, str(checkpoint),
                                            list(ids), dtype))


__all__ = ["generate_tensor_parallel", "run_tensor_parallel", "tensor_parallel_logits"]
