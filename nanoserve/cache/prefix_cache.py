"""Prefix caching's block identity and lookup, in plain Python (no torch).

A full block of `block_size` tokens is named by a hash chained over its parent's hash and its
own token ids, so a block names the whole prefix that ends with it, and equal token ids at
another position (another parent) are another block:

    prompt:  [t0 .. t15][t16 .. t31][t32 .. t40]     block_size 16
    hashes:  h0 = H(ROOT, t0..t15), h1 = H(h0, t16..t31); the partial block has none

A row under a LoRA adapter starts its chain at `prefix_root(adapter)` instead of ROOT: its
blocks hold that adapter's keys and values, never served to another adapter or the base.

The allocator (`nanoserve.cache.block_manager.BlockAllocator`) indexes the blocks whose contents are
known by these hashes; `lookup` walks a prompt's chain through that index.

Admitting a row (all or nothing), then prefilling only what the cache lacks:

    hit = lookup(allocator, prompt, block_size)            # changes nothing
    if blocks_to_admit(allocator, hit, len(prompt), block_size) > allocator.num_free:
        the row waits (nothing changed)
    table.take_cached(hit, allocator)                      # references +1; table.num_tokens
    slots = table.append(len(prompt) - table.num_tokens, allocator)   # the new tokens' slots
    ... store the new tokens' K/V at `slots`, run `kernels.paged_prefill_attention` ...
    table.register_full_blocks(prompt, allocator)          # after the step that wrote them

and after each decode step `table.register_full_blocks(tokens_so_far, allocator)`, so a
preempted row finds its own blocks again when it is recomputed.

Why blake2b, not Python's `hash()` of a tuple: `hash()` is 64 bits and not collision
resistant (token ids that collide can be found on purpose), and a collision would silently
give one row another prompt's keys and values. blake2b is in the standard library, takes
about two microseconds per block (packing included), and its 256-bit digest makes accidental
or crafted collisions practically impossible; it is also the same in every process, so a
driver can name a prefix the way a worker's pool does.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Protocol

ROOT_HASH = b"nanoserve-prefix-root"  # the parent of a prompt's first block


def prefix_root(lora: str | None = None) -> bytes:
    """The parent of a prompt's first block under LoRA adapter `lora` (None: the base
    model, `ROOT_HASH`): the same tokens under another adapter, or none, are other blocks,
    so a block computed under one adapter is never reused for another."""
    if lora is None:
        return ROOT_HASH
    return hashlib.blake2b(ROOT_HASH + b"\0lora\0" + lora.encode("utf-8"),
                           digest_size=32).digest()


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64s (any id an engine can see packs without loss)."""
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _chain(parent: bytes, packed: bytes, block_size: int) -> Iterator[bytes]:
    """The chained names of the full blocks of `packed` token ids, one at a time."""
    width = 8 * block_size
    for start in range(0, len(packed) - width + 1, width):
        parent = hashlib.blake2b(parent + packed[start : start + width], digest_size=32).digest()
        yield parent


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: blake2b over the parent's name and the block's token ids."""
    return hashlib.blake2b(parent + _pack(token_ids), digest_size=32).digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes = ROOT_HASH,
    max_blocks: int | None = None,
) -> list[bytes]:
    """Chained names of the full blocks of `token_ids` (at most `max_blocks`), in order."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    return list(_chain(parent, _pack(token_ids[: num_full * block_size]), block_size))


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks may come from the cache: full blocks only, and never the
    whole prompt, so at least its last token is prefilled and the row has logits to sample."""
    return max(0, (num_prompt_tokens - 1) // block_size)


class _HashIndex(Protocol):
    def cached_block(self, block_hash: bytes) -> int | None: ...

    def num_free_taken_by(self, blocks: Sequence[int]) -> int: ...


def lookup(allocator: _HashIndex, prompt_token_ids: Sequence[int], block_size: int) -> list[int]:
    """The physical blocks of the longest cached run of the prompt's leading full blocks
    (capped by `max_cached_blocks`). Changes nothing: a row takes them with
    `BlockTable.take_cached`. Names are computed block by block, so a miss at block 0 costs one."""
    out: list[int] = []
    usable = max_cached_blocks(len(prompt_token_ids), block_size) * block_size
    for name in _chain(ROOT_HASH, _pack(prompt_token_ids[:usable]), block_size):
        block = allocator.cached_block(name)
        if block is None:
            break
        out.append(block)
    return out


def blocks_to_admit(
    allocator: _HashIndex, hit: Sequence[int], num_prompt_tokens: int, block_size: int
) -> int:
    """Free blocks a row's admission uses up: the hit's blocks that wait in the cached-free
    LRU (taking them removes them from it) plus new blocks for the rest of the prompt."""
    new_blocks = -(-num_prompt_tokens // block_size) - len(hit)
    return allocator.num_free_taken_by(hit) + new_blocks


__all__ = [
    "ROOT_HASH",
    "blocks_to_admit",
    "hash_block",
    "hash_blocks",
    "prefix_root",
    "lookup",
    "max_cached_blocks",
]
