"""A padded prefill on the CPU runs its projections and MLP on the real tokens only, packed
into one row (`nanoserve.model.model.packs_prefill`), and puts q/k/v back into the rectangle for
the attention. Held to the same forward run on the whole rectangle: the same hidden states
at the real positions, zeros in the padding, the same keys and values in the KV pool."""

from __future__ import annotations

import pytest
import torch

from nanoserve.cache.pool import BatchedPagedKVCache, CacheShape, KVPool
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import build_model, packs_prefill
from nanoserve.static.generate import greedy_generate, greedy_generate_batch
from nanoserve.weights.weights import load_checkpoint

LENS = (3, 1, 7, 5)


def rectangle(lens, vocab, right=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lens), max(lens)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    cols = torch.arange(T)[None]
    n = torch.tensor(lens)[:, None]
    valid = cols < n if right else cols >= T - n
    ids = ids.masked_fill(~valid, 0)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # each row from position 0
    return ids, positions, valid


def run(model, ids, positions, valid, packed: bool):
    """The model's hidden states [B, T, d] for this prefill, and the pool it wrote."""
    pool = KVPool(CacheShape.of(model.config), 16, 4)
    cache = BatchedPagedKVCache(pool, ids.shape[0])
    meta = AttentionMetadata.prefill(valid)
    inner = model.model
    with torch.inference_mode():
        out = inner(ids, positions, cache, meta) if packed else inner._forward(ids, positions,
                                                                                  cache, meta)
    return out, pool


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory, smollm2_gguf_path):
    """A tiny Mistral with a sliding window of 3 on every layer."""
    from nanoserve.testing import save_tiny_family

    folder = save_tiny_family(tmp_path_factory.mktemp("mistral"), "mistral", smollm2_gguf_path,
                              sliding_window=3)
    config, sd = load_checkpoint(folder)
    return build_model(config, sd)


@pytest.mark.parametrize("right", [True, False], ids=["right-padded", "left-padded"])
@pytest.mark.parametrize("which", ["tiny_model", "mistral_window"])
def test_packed_prefill_equals_the_rectangle(request, which, right):
    model = request.getfixturevalue(which)
    ids, positions, valid = rectangle(LENS, model.config.vocab_size, right)
    assert packs_prefill(ids, AttentionMetadata.prefill(valid))
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, args, out: seen.append(tuple(args[0].shape)))
    try:
        packed, packed_pool = run(model, ids, positions, valid, packed=True)
        full, full_pool = run(model, ids, positions, valid, packed=False)
    finally:
        hook.remove()
    n = sum(LENS)
    assert seen[0][:2] == (1, n)  # the MLP saw the real tokens only
    assert seen[1][:2] == ids.shape  # the rectangle: every padded column
    torch.testing.assert_close(packed[valid], full[valid], rtol=1e-5, atol=1e-5)
    assert not packed[~valid].any()
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(packed_pool.k[layer], full_pool.k[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_pool.v[layer], full_pool.v[layer], rtol=1e-5, atol=1e-5)


def test_no_packing_without_padding_or_on_decode(tiny_model):
    ids, _, valid = rectangle((4, 4), tiny_model.config.vocab_size)
    assert not packs_prefill(ids, AttentionMetadata.prefill(valid))
    assert not packs_prefill(ids, AttentionMetadata.prefill())
    assert not packs_prefill(ids[:, :1], AttentionMetadata.decode())


def test_packed_batch_equals_each_row_alone(mistral_window):
    """Through the static batch (packed prefill, then paged decode steps): each row's
    greedy tokens equal the row run alone through the dense cache."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, mistral_window.config.vocab_size, (n,), generator=g).tolist()
               for n in (2, 9, 5, 1, 12)]
    alone = [greedy_generate(mistral_window, p, 10) for p in prompts]
    assert greedy_generate_batch(mistral_window, prompts, 10) == alone
