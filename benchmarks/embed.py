"""Embedding throughput: nanoserve's packed prefill (nanoserve/embed.py) against
sentence-transformers' `encode`, same model files, same rows, same process, same dtype.

    python -m benchmarks.embed                      # one H200: Qwen3-Embedding-0.6B shape,
                                                    # 100,000 rows of 50-500 tokens, bf16
    python -m benchmarks.embed --shape tiny --rows 200 --min-tokens 8 --max-tokens 40 \\
        --device cpu --dtype float32                # a CPU check that the script runs

The model is random (seeded): transformers' `Qwen3Model` of the chosen shape, saved with
sentence-transformers' files (last-token pooling, Normalize, max_seq_length 512) and a
word-level tokenizer whose words `w<i>` are token i, so each row's text is exactly its
random token ids for both engines (tokenizing is timed for both). Prints a Markdown table
(rows/s, tokens/s, the ratio to sentence-transformers) and how closely the two engines'
vectors agree (cosine over the first rows). Without sentence-transformers installed (or with
--no-st) only nanoserve is timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

SHAPES = {
    # Qwen/Qwen3-Embedding-0.6B's config.json
    "qwen3-0.6b": dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def save_model(folder: Path, shape: str, dtype, device: str, seed: int) -> int:
    """A random Qwen3Model with sentence-transformers' files and a word-level tokenizer;
    returns the vocabulary size."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(**SHAPES[shape], bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3Model(cfg).to(dtype)
    model.save_pretrained(folder)
    del model
    v = cfg.vocab_size
    vocab = {f"w{i}": i for i in range(v - 2)} | {"[UNK]": v - 2, "[PAD]": v - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
         "pad_token": "[PAD]", "model_max_length": 512}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
         "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
         "pooling_mode_lasttoken": True, "include_prompt": True}))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return v


def make_rows(n: int, lo: int, hi: int, vocab: int, seed: int) -> tuple[list[str], int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=n)
    texts = [" ".join(f"w{t}" for t in rng.integers(0, vocab - 2, size=k)) for k in lens]
    return texts, int(lens.sum())


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_nanoserve(folder: Path, texts: list[str], args) -> tuple[float, object]:
    import torch

    from nanoserve.embed import Embedder

    emb = Embedder.load(str(folder), dtype=args.dtype, device=args.device,
                        max_batch_tokens=args.batch_tokens)
    emb.embed(texts[:64])  # warm-up: kernels compiled, allocator primed
    sync(args.device)
    t0 = time.perf_counter()
    out = emb.embed(texts)
    sync(args.device)
    seconds = time.perf_counter() - t0
    del emb
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds, out


def time_st(folder: Path, texts: list[str], args) -> tuple[float, object]:
    import torch
    from sentence_transformers import SentenceTransformer

    dtype = getattr(torch, args.dtype)
    st = SentenceTransformer(str(folder), device=args.device).to(dtype)
    st.encode(texts[:64], batch_size=args.st_batch_size)
    sync(args.device)
    t0 = time.perf_counter()
    out = st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True,
                    show_progress_bar=False)
    sync(args.device)
    return time.perf_counter() - t0, out.float().cpu()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--min-tokens", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=500)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batch-tokens", type=int, default=65536,
                   help="nanoserve: tokens per packed prefill (default: 65536)")
    p.add_argument("--st-batch-size", type=int, default=128,
                   help="sentence-transformers: rows per encode batch (default: 128)")
    p.add_argument("--no-st", action="store_true", help="time nanoserve only")
    p.add_argument("--check-rows", type=int, default=512,
                   help="rows whose vectors the two engines are compared on")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from benchmarks.common import git_commit

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="nanoserve-embed-bench-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        vocab = save_model(folder, args.shape, dtype, args.device, args.seed)
        texts, tokens = make_rows(args.rows, args.min_tokens, args.max_tokens, vocab, args.seed)
        setup = time.perf_counter() - t0
        results = [("nanoserve", *time_nanoserve(folder, texts, args))]
        if not args.no_st:
            try:
                results.append(("sentence-transformers", *time_st(folder, texts, args)))
            except ImportError as e:
                print(f"sentence-transformers not installed ({e}): timing nanoserve only")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"commit {git_commit()}; {device}; {args.shape} shape, random weights, {args.dtype}; "
          f"{args.rows:,} rows of {args.min_tokens}-{args.max_tokens} tokens ({tokens:,} "
          f"tokens); last-token pooling, normalised; setup {setup:.1f} s")
    print(f"nanoserve: {args.batch_tokens} tokens per packed prefill; sentence-transformers: "
          f"batch_size {args.st_batch_size}\n")
    base = results[-1][1] if len(results) > 1 else None
    print("| engine | seconds | rows/s | tokens/s | speed-up vs sentence-transformers |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seconds, _ in results:
        ratio = f"{base / seconds:.2f}x" if base else "-"
        print(f"| {name} | {seconds:.1f} | {args.rows / seconds:,.0f} | "
              f"{tokens / seconds:,.0f} | {ratio} |")
    if len(results) > 1:
        k = min(args.check_rows, args.rows)
        a, b = results[0][2][:k], results[1][2][:k]
        cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
        print(f"\nagreement over {k} rows: cosine min {cos.min():.5f}, mean {cos.mean():.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
