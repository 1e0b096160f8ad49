"""transformers as the oracle of the model tests: its greedy tokens from its plain forward."""

from __future__ import annotations

import torch


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens from its plain forward over the whole sequence at each
    step (no cache). Its `generate` is not used: with a Mistral `sliding_window` of 4096 and
    tiny shapes it picked a token its own forward ranks second (checked on the CPU)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_greedy_near(hf, prompts, got, want, tie=1e-4):
    """Greedy tokens equal transformers', except where transformers' own logits at the first
    divergence hold a near tie (|gap| < tie) between its token and ours: float32 on another
    device sums in another order, and a tiny random model's logits tie often. At most one
    prompt may diverge."""
    diverged = 0
    for prompt, g, w in zip(prompts, got, want, strict=True):
        if g == w:
            continue
        diverged += 1
        j = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + w[:j]])).logits[0, -1].float()
        gap = float(logits[w[j]] - logits[g[j]])
        assert 0 <= gap < tie, (j, g[j], w[j], gap)
    assert diverged <= 1, f"{diverged} prompts diverged"


def hf_tokenizer(folder):
    """transformers' fast tokenizer over a checkpoint folder's tokenizer.json (the ids a
    test expects, made without nanoserve's tokenizer)."""
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(Path(folder) / "tokenizer.json"))


def label_logprob_sums(hf, prompt_ids: list[int], labels_ids: list[list[int]]) -> list[float]:
    """Each label's summed log-probability after the prompt: transformers' forward over
    prompt + label, log-softmax over the vocabulary in float64 at each label token."""
    sums = []
    n = len(prompt_ids)
    for ids in labels_ids:
        with torch.no_grad():
            logits = hf(torch.tensor([list(prompt_ids) + list(ids)])).logits[0]
        logp = torch.log_softmax(logits.double(), dim=-1)
        sums.append(sum(logp[n - 1 + t, tok].item() for t, tok in enumerate(ids)))
    return sums


def label_probabilities(hf, prompt_ids: list[int], labels_ids: list[list[int]]) -> list[float]:
    """The labels' probabilities: softmax of `label_logprob_sums` over the labels."""
    sums = torch.tensor(label_logprob_sums(hf, prompt_ids, labels_ids), dtype=torch.float64)
    return torch.softmax(sums, dim=0).tolist()


def qwen2_5_vl_generate(hf, tok, proc, ids: list[int], images: list, new_tokens: int
                        ) -> tuple[list[int], int]:
    """transformers' greedy tokens of Qwen2.5-VL `hf` after the prompt `ids` (one
    <|image_pad|> per image, as its chat template writes them) and the PIL `images`:
    `proc` (its image processor) makes pixel values and grids, each <|image_pad|> is widened
    to grid_t * grid_h * grid_w / merge**2 tokens (what Qwen2_5_VLProcessor does), then
    `generate` with `mm_token_type_ids` (without them transformers 5.x computes no M-RoPE
    positions). Returns (new tokens, prompt tokens after widening)."""
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    kw = {}
    if images:
        out = proc(images=images, return_tensors="pt")
        merge = getattr(proc, "merge_size", 2)
        counts = iter((out["image_grid_thw"].prod(-1) // merge**2).tolist())
        ids = [t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]
        kw = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        gen = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          mm_token_type_ids=(input_ids == pad).int(),
                          max_new_tokens=new_tokens, do_sample=False, **kw)
    return gen[0, len(ids):].tolist(), len(ids)
