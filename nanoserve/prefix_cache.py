"""Prefix caching's block identity and lookup, in plain Python (no torch).

A full block of `block_size` tokens is named by a hash chained over its parent's hash and its
own token ids, so a block names the whole prefix that ends with it, and equal token ids at
another position (another parent) are another block:

    prompt:  [t0 .. t15][t16 .. t31][t32 .. t40]     block_size 16
    hashes:  h0 = H(ROOT, t0..t15), h1 = H(h0, t16..t31); the partial block has none

The allocator (`nanoserve.block_manager.BlockAllocator`) indexes the blocks whose contents are
known by these hashes; `lookup` walks a prompt's chain through that index.

Why blake2b, not Python's `hash()` of a tuple: `hash()` is 64 bits and not collision
resistant (token ids that collide can be found on purpose), and a collision would silently
give one row another prompt's keys and values. blake2b is in the standard library, takes
about a microsecond per block, and its 256-bit digest makes accidental or crafted collisions
practically impossible; it is also the same in every process, so a driver can name a prefix
the way a worker's pool does.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

ROOT_HASH = b"nanoserve-prefix-root"  # the parent of a prompt's first block
_DIGEST_BYTES = 32


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: blake2b over the parent's name and the block's token ids
    (each as a little-endian int64, so any id an engine can see packs without loss)."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


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
    out: list[bytes] = []
    for i in range(num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks may come from the cache: full blocks only, and never the
    whole prompt, so at least its last token is prefilled and the row has logits to sample."""
    return max(0, (num_prompt_tokens - 1) // block_size)


class _HashIndex(Protocol):
    def cached_block(self, block_hash: bytes) -> int | None: ...


def lookup(allocator: _HashIndex, prompt_token_ids: Sequence[int], block_size: int) -> list[int]:
    """The physical blocks of the longest cached run of the prompt's leading full blocks
    (capped by `max_cached_blocks`). Changes nothing: a row takes them with
    `BlockTable.take_cached`. Hashes are computed lazily, so a miss at block 0 costs one."""
    out: list[int] = []
    parent = ROOT_HASH
    for i in range(max_cached_blocks(len(prompt_token_ids), block_size)):
        parent = hash_block(parent, prompt_token_ids[i * block_size : (i + 1) * block_size])
        block = allocator.cached_block(parent)
        if block is None:
            break
        out.append(block)
    return out


__all__ = ["ROOT_HASH", "hash_block", "hash_blocks", "lookup", "max_cached_blocks"]
