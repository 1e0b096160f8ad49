"""Classification throughput on one GPU: nanoserve's classifiers (nanoserve/classify.py)
against transformers and vLLM 0.26.0 (`LLM.classify`), the same token-id rows through each,
back to back in one call, on the same random checkpoint folder.

Shapes (random weights of the released configs' shapes, drawn by transformers' own init,
seeded, saved as bf16 safetensors by `save_pretrained`; two labels):
- decoder: Qwen3-0.6B's config as `Qwen3ForSequenceClassification` (the pooled row's last
  token, `score` [2, 1024]; pad_token_id 151643, Qwen3's <|endoftext|>);
- encoder: bert-base-uncased's config as `BertForSequenceClassification` ([CLS] pooled
  through the pooler's dense + tanh, then `classifier` [2, 768]).
Each folder also holds a word-level tokenizer over the whole vocabulary (`<t17>` is id 17;
tokenizer.json, which nanoserve's loader reads, and a tokenizer_config.json for
transformers' `AutoTokenizer`); no side tokenizes anything in the timed region.

Rows (`make_rows`, numpy seeded): `--rows` rows (100,000) whose lengths are uniform in
[--min-len, --max-len] ([50, 500]) tokens, all special tokens included: the decoder's are
random ids below Qwen3's first special token (so no row holds the pad id); the encoder's
are [CLS] (101), random ids of bert-base's word pieces (999 and up), [SEP] (102). Every
side gets the same rows in the same order (drawn order, not sorted), and an untimed warm-up
first: `--warmup-rows` rows of the same distribution, another seed.

Sides (bf16 on a GPU; float32 in --smoke):
- vllm: first, in a child process whose PYTHONPATH is only --vllm-site (vLLM and its
  dependencies installed there with `pip install --target`), VLLM_USE_FLASHINFER_SAMPLER=0:
  `LLM(model=DIR, runner="pooling", skip_tokenizer_init=True, dtype=..., max_model_len=512,
  gpu_memory_utilization=0.9)` (--vllm-with-tokenizer: the folder's tokenizer loaded
  instead of skip_tokenizer_init, the rows still token ids), its defaults otherwise
  (torch.compile, CUDA graphs, its batched-token budget), then one `LLM.classify([TokensPrompt(prompt_token_ids=row), ...],
  pooling_params=PoolingParams(use_activation=False))` over all rows: raw logits, no
  softmax. The child exits and leaves the GPU whole for the next side;
- nanoserve: in this process, `load_classifier(DIR, dtype, max_batch_tokens=--batch-tokens)`
  (`DecoderClassifier` or `Encoder`), one `classify_ids(rows)` call (rows packed back to
  back into prefills of at most --batch-tokens tokens, no padding, no KV cache; logits
  float32 on the CPU); then the model is dropped and the CUDA cache emptied;
- hf: transformers' `AutoModelForSequenceClassification.from_pretrained(DIR, dtype)` on the
  GPU in eval mode, its default attention (sdpa), `torch.inference_mode()`; rows sorted by
  length (longest first), batches of --hf-batch-size rows right-padded to the batch's
  longest with the pad id and an attention mask, logits kept on the GPU until the end, then
  put back in input order. sentence-transformers' `CrossEncoder.predict` runs this same
  model class on rows sorted by text length, tokenizing each batch (32 rows by default):
  transformers over pre-tokenized rows, sorted by token count, in batches of 128 does the
  same device work without the tokenizer, the stricter baseline, and the only one timed.
Each side's time is one call over all rows, host work included (for nanoserve and hf the
building of their tensors from the id lists), load and warm-up excluded.

Prints one table per call (seconds, rows/s, tokens/s, nanoserve's rate over each side's,
against the target: >= 2x hf, >= 1.3x vLLM), then one agreement line per shape and side:
each side's logits against the reference (hf where it ran, else nanoserve): the share of
rows with the same argmax label (the check: >= 99%), the largest and mean |logit
difference|, and of the rows whose label differs, the reference's largest top-2 margin (a
near-tie shows as a small margin). Results (without the logits) go to
DIR/classify[_smoke].json.

    python3 -m benchmarks.classify [--shapes decoder,encoder] [--sides nanoserve,hf,vllm]
        [--rows 100000] [--min-len 50] [--max-len 500] [--out DIR] [--vllm-site /tmp/vsite]
        [--batch-tokens 65536] [--hf-batch-size 128] [--warmup-rows 1024]
        [--vllm-with-tokenizer]
    python3 -m benchmarks.classify --smoke   # a tiny shape of each on the CPU, 24 rows,
                                             # nanoserve and hf (tests/test_bench_classify.py)

This module imports only the standard library at the top: the vLLM child runs this file
with vLLM's PYTHONPATH, and must import vllm before torch and never import nanoserve.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("nanoserve", "hf", "vllm")
SHAPES = ("decoder", "encoder")
TARGETS = {"hf": 2.0, "vllm": 1.3}  # nanoserve's rows/s over the side's, issue 66
AGREE = 0.99  # the share of rows whose argmax label must equal the reference's
LABELS = {0: "negative", 1: "positive"}

# The released config.json of each, as transformers' config keyword arguments.
MODELS = {
    "decoder": dict(
        name="Qwen3-0.6B", model_type="qwen3", architecture="Qwen3ForSequenceClassification",
        config=dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                    attention_bias=False, bos_token_id=151643, eos_token_id=151645,
                    pad_token_id=151643),
        ids=(0, 151643), prefix=(), suffix=()),
    "encoder": dict(
        name="bert-base-uncased", model_type="bert", architecture="BertForSequenceClassification",
        config=dict(vocab_size=30522, hidden_size=768, intermediate_size=3072,
                    num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=512,
                    type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
                    pad_token_id=0),
        ids=(999, 30522), prefix=(101,), suffix=(102,)),
}
# --smoke: the same architectures, narrow and 2 layers deep
SMOKE = {
    "decoder": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=1024, bos_token_id=998, eos_token_id=999,
                    pad_token_id=998),
    "encoder": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4),
}
SMOKE_IDS = {"decoder": (0, 998), "encoder": (200, 1000)}


def model_spec(shape: str, smoke: bool) -> dict:
    """The shape's record: name, model_type, architecture, config (transformers keywords,
    two labels), ids (the body's id range [lo, hi)), prefix and suffix (special ids)."""
    spec = dict(MODELS[shape])
    config = dict(spec["config"])
    if smoke:
        config.update(SMOKE[shape])
        spec["ids"] = SMOKE_IDS[shape]
        spec["name"] += " (smoke: 2 narrow layers)"
    spec["config"] = {**config, "num_labels": len(LABELS), "id2label": dict(LABELS),
                      "label2id": {v: k for k, v in LABELS.items()}}
    return spec


def make_rows(n: int, lo: int, hi: int, ids: tuple[int, int], prefix=(), suffix=(),
              seed: int = 0) -> list[list[int]]:
    """n rows of token ids, lengths uniform in [lo, hi] (prefix and suffix counted), body ids
    uniform in [ids[0], ids[1])."""
    import numpy as np

    rng = np.random.default_rng(seed)
    specials = len(prefix) + len(suffix)
    lens = rng.integers(max(lo, specials + 1), hi + 1, size=n) - specials
    flat = rng.integers(ids[0], ids[1], size=int(lens.sum()))
    pre, post = list(prefix), list(suffix)
    return [pre + part.tolist() + post for part in np.split(flat, np.cumsum(lens)[:-1])]


def shape_rows(spec: dict, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    return make_rows(n, lo, hi, tuple(spec["ids"]), tuple(spec["prefix"]),
                     tuple(spec["suffix"]), seed)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --- the random checkpoint folder --------------------------------------------------------------


def model_folder(folder: Path, spec: dict, dtype: str, device: str, seed: int) -> Path:
    """transformers' random `spec["architecture"]` of the shape, saved in `folder` with a
    word-level tokenizer over the whole vocabulary (`<t17>` is id 17; tokenizer.json and a
    tokenizer_config.json naming the fast tokenizer class); reused when a complete folder of
    the same spec is already there."""
    want = {"spec": spec, "dtype": dtype, "seed": seed}
    done = folder / ".complete"
    try:
        if done.exists() and json.loads(done.read_text()) == want:
            print(f"reusing the random model in {folder}", flush=True)
            return folder
    except (OSError, ValueError):
        pass
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = time.perf_counter()
    done.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    cfg.architectures = [spec["architecture"]]
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, spec["architecture"])(cfg).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    config = json.loads((folder / "config.json").read_text())
    config.setdefault("torch_dtype", dtype)  # what vLLM reads for dtype "auto"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"<t{i}>": i for i in range(spec["config"]["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(  # for --vllm-with-tokenizer
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<t0>",
         "pad_token": f"<t{config['pad_token_id']}>",
         "model_max_length": config["max_position_embeddings"]}))
    done.write_text(json.dumps(want))
    print(f"random {spec['architecture']} ({n_params / 1e6:,.1f}M parameters, {dtype}) written "
          f"to {folder} in {time.perf_counter() - t:.0f} s", flush=True)
    return folder


# --- nanoserve and transformers, in this process -----------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> float | None:
    """Collects garbage and empties the CUDA cache; the GPU's free GiB (None on the CPU)."""
    import torch

    gc.collect()
    if device != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / 2**30


def run_nanoserve(folder: Path, rows: list, warm: list, device: str, dtype: str,
                  batch_tokens: int):
    """(side record, logits [N, labels] float32 on the CPU)."""
    from nanoserve.classify import load_classifier

    t = time.perf_counter()
    clf = load_classifier(folder, dtype=dtype, device=device, max_batch_tokens=batch_tokens)
    _sync(device)
    load_s = time.perf_counter() - t
    clf.classify_ids(warm)
    _sync(device)
    t = time.perf_counter()
    logits = clf.classify_ids(rows)
    _sync(device)
    side = {"seconds": time.perf_counter() - t, "load_s": load_s,
            "classifier": type(clf).__name__, "max_batch_tokens": batch_tokens}
    del clf
    side["gpu_free_after_gib"] = _free(device)
    return side, logits


def hf_classify(model, rows: list, pad_id: int, batch_size: int, device: str):
    """transformers' logits [N, labels] float32 on the CPU, in input order: rows sorted
    longest first, batches right-padded to their longest row with an attention mask."""
    import torch

    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    outs = []
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = len(rows[idx[0]])
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for j, i in enumerate(idx):
                n = len(rows[i])
                ids[j, :n] = torch.tensor(rows[i])
                mask[j, :n] = 1
            outs.append(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits)
        logits = torch.cat(outs).float().cpu()
    out = torch.empty_like(logits)
    out[torch.tensor(order)] = logits
    return out


def run_hf(folder: Path, rows: list, warm: list, device: str, dtype: str, batch_size: int):
    """(side record, logits [N, labels] float32 on the CPU)."""
    import torch
    import transformers

    t = time.perf_counter()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=getattr(torch, dtype)).to(device).eval()
    pad_id = model.config.pad_token_id
    _sync(device)
    load_s = time.perf_counter() - t
    hf_classify(model, warm, pad_id, batch_size, device)
    _sync(device)
    t = time.perf_counter()
    logits = hf_classify(model, rows, pad_id, batch_size, device)
    _sync(device)
    side = {"seconds": time.perf_counter() - t, "load_s": load_s, "batch_size": batch_size,
            "attention": getattr(model.config, "_attn_implementation", None),
            "transformers": transformers.__version__}
    del model
    side["gpu_free_after_gib"] = _free(device)
    return side, logits


# --- vLLM, in a child process ------------------------------------------------------------------


def run_vllm(folder: Path, spec: dict, work: Path, args) -> tuple[dict | None, object, str]:
    """Runs this file with --vllm-child under vLLM's environment (`args.vllm_site` alone on
    the path, its own session, killed with its engine-core process after
    `args.vllm_timeout` s): (side record or None, logits or None, error)."""
    import torch

    stem = f"vllm_{spec['shape']}"
    spec_path, result_path = work / f"{stem}.json", work / f"{stem}_result.json"
    spec_path.write_text(json.dumps({**spec, "model": str(folder)}))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": args.vllm_site, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    out_log, err_log = work / f"{stem}.stdout", work / f"{stem}.stderr"
    # -P: not even the script's folder (benchmarks/) on sys.path
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--vllm-child",
           "--vllm-spec", str(spec_path), "--vllm-result", str(result_path)]
    print(f"vLLM child: PYTHONPATH={args.vllm_site} {' '.join(cmd)} (logs in {work})", flush=True)
    with open(out_log, "w") as so, open(err_log, "w") as se:
        proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=so, stderr=se,
                                start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its engine-core process
            proc.wait()
            rc = f"killed after {args.vllm_timeout} s"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    if rc == 0 and result and "logits" in result:
        logits = torch.tensor(result.pop("logits"), dtype=torch.float32)
        return result, logits, ""
    tail = _tail(err_log) or _tail(out_log)
    return result, None, f"vLLM child failed (exit {rc}); last 40 lines of its stderr:\n{tail}"


def vllm_child(spec_path: Path, result_path: Path) -> None:
    """In the child: vLLM first (no torch, no nanoserve before it)."""
    import vllm
    from vllm import LLM

    try:
        from vllm import PoolingParams, TokensPrompt
    except ImportError:
        from vllm.inputs import TokensPrompt
        from vllm.pooling_params import PoolingParams

    spec = json.loads(spec_path.read_text())
    rows = shape_rows(spec, spec["rows"], spec["min_len"], spec["max_len"], spec["seed"])
    warm = shape_rows(spec, spec["warmup_rows"], spec["min_len"], spec["max_len"],
                      spec["seed"] + 1)
    t = time.perf_counter()
    llm = LLM(model=spec["model"], runner="pooling",
              skip_tokenizer_init=not spec.get("with_tokenizer"),
              dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              gpu_memory_utilization=spec["gpu_memory_utilization"])
    result = {"vllm_version": vllm.__version__, "load_s": time.perf_counter() - t,
              "max_model_len": spec["max_model_len"]}
    try:  # what vLLM chose by default, for the record
        cfg = llm.llm_engine.vllm_config
        result.update(model_dtype=str(cfg.model_config.dtype),
                      max_num_seqs=cfg.scheduler_config.max_num_seqs,
                      max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens)
    except Exception as e:  # noqa: BLE001 - only the record is lost
        result["config_error"] = repr(e)
    try:  # raw logits, as the other sides give
        params = PoolingParams(use_activation=False)
        result["activation"] = False
    except TypeError:
        params, result["activation"] = None, True  # then `probs` are softmax(logits)

    llm.classify([TokensPrompt(prompt_token_ids=r) for r in warm], pooling_params=params,
                 use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
    t = time.perf_counter()
    outs = llm.classify(prompts, pooling_params=params, use_tqdm=False)
    result["seconds"] = time.perf_counter() - t
    if len(outs) != len(rows):
        raise SystemExit(f"vLLM gave {len(outs)} outputs for {len(rows)} rows")
    result["logits"] = [list(map(float, o.outputs.probs)) for o in outs]
    print(f"vLLM {spec['shape']}: {result['seconds']:.2f} s, "
          f"{len(rows) / result['seconds']:,.0f} rows/s", flush=True)
    result_path.write_text(json.dumps(result))
    del llm
    gc.collect()


# --- agreement and the table -------------------------------------------------------------------


def agreement(ref, got, ref_is_probs: bool = False, got_is_probs: bool = False) -> dict:
    """How closely `got` [N, L] follows `ref` [N, L] (logits, or softmax probabilities where
    a side gave only those: then both are compared as probabilities)."""
    import torch

    if ref_is_probs != got_is_probs:
        ref = ref if ref_is_probs else ref.softmax(-1)
        got = got if got_is_probs else got.softmax(-1)
    same = ref.argmax(-1) == got.argmax(-1)
    diff = (ref - got).abs()
    top2 = ref.topk(min(2, ref.shape[-1]), dim=-1).values
    margin = (top2[:, 0] - top2[:, -1]) if ref.shape[-1] > 1 else torch.zeros(len(ref))
    flipped = margin[~same]
    return {"rows": len(ref), "argmax_equal": float(same.float().mean()),
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "flipped_max_margin": float(flipped.max()) if len(flipped) else None,
            "compared": "probabilities" if (ref_is_probs or got_is_probs) else "logits"}


def print_table(results: dict) -> None:
    print("\n| shape | side | seconds | rows/s | tokens/s | nanoserve over side | target |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for shape, r in results["shapes"].items():
        ours = r["sides"].get("nanoserve")
        for side in [s for s in SIDES if s in r["sides"]]:
            s = r["sides"][side]
            ratio, target = "-", "-"
            if ours and side != "nanoserve":
                x = s["seconds"] / ours["seconds"]
                ratio = f"{x:.2f}x"
                goal = TARGETS[side]
                target = f">= {goal}x: {'met' if x >= goal else 'not met'}"
            print(f"| {shape} | {side} | {s['seconds']:.2f} | {r['rows'] / s['seconds']:,.0f} | "
                  f"{r['tokens'] / s['seconds']:,.0f} | {ratio} | {target} |")
    print()
    for shape, r in results["shapes"].items():
        for side, a in r.get("agreement", {}).items():
            margin = a["flipped_max_margin"]
            print(f"agreement, {shape}, {side} vs {r['reference']}: argmax equal on "
                  f"{a['argmax_equal']:.2%} of {a['rows']:,} rows (>= {AGREE:.0%}: "
                  f"{'yes' if a['argmax_equal'] >= AGREE else 'NO'}); {a['compared']} "
                  f"max |diff| {a['max_abs_diff']:.5f}, mean {a['mean_abs_diff']:.6f}; "
                  f"differing rows' largest {r['reference']} margin "
                  f"{'-' if margin is None else f'{margin:.5f}'}")
        if r.get("vllm_error"):
            print(f"vllm, {shape}: {r['vllm_error']}")
    for shape, r in results["shapes"].items():
        loads = ", ".join(f"{k} {v['load_s']:.1f} s" for k, v in r["sides"].items())
        if loads:
            print(f"{shape}: load (untimed) {loads}")
    sys.stdout.flush()


def run_shape(shape: str, args, device: str, dtype: str, sides: list[str], work: Path) -> dict:
    spec = model_spec(shape, args.smoke)
    folder = model_folder(work / f"{shape}-{'smoke' if args.smoke else 'random'}", spec, dtype,
                          device, args.seed)
    rows = shape_rows(spec, args.rows, args.min_len, args.max_len, args.seed)
    warm = shape_rows(spec, args.warmup_rows, args.min_len, args.max_len, args.seed + 1)
    tokens = sum(map(len, rows))
    print(f"{shape}: {spec['name']} as {spec['architecture']}; {len(rows):,} rows, "
          f"{tokens:,} tokens ({args.min_len}-{args.max_len} a row); warm-up "
          f"{len(warm):,} rows", flush=True)
    out: dict = {"model": spec["name"], "architecture": spec["architecture"],
                 "folder": str(folder), "rows": len(rows), "tokens": tokens, "sides": {}}
    logits: dict = {}
    probs: set[str] = set()
    if "vllm" in sides:  # first: its child exits and leaves the GPU whole for the others
        max_len = min(spec["config"]["max_position_embeddings"], max(512, args.max_len))
        child = {"shape": shape, **spec, "rows": args.rows, "min_len": args.min_len,
                 "max_len": args.max_len, "seed": args.seed, "warmup_rows": args.warmup_rows,
                 "dtype": dtype, "max_model_len": max_len,
                 "with_tokenizer": args.vllm_with_tokenizer,
                 "gpu_memory_utilization": args.gpu_memory_utilization}
        side, got, error = run_vllm(folder, child, work, args)
        if error:
            out["vllm_error"] = error
            print(error, flush=True)
        else:
            out["sides"]["vllm"], logits["vllm"] = side, got
            if side.get("activation"):
                probs.add("vllm")
    if "nanoserve" in sides:
        out["sides"]["nanoserve"], logits["nanoserve"] = run_nanoserve(
            folder, rows, warm, device, dtype, args.batch_tokens)
    if "hf" in sides:
        out["sides"]["hf"], logits["hf"] = run_hf(folder, rows, warm, device, dtype,
                                                  args.hf_batch_size)
    for side, s in out["sides"].items():
        print(f"{shape}, {side}: {s['seconds']:.2f} s, {len(rows) / s['seconds']:,.0f} rows/s",
              flush=True)
    ref = "hf" if "hf" in logits else "nanoserve" if "nanoserve" in logits else None
    out["reference"] = ref
    if ref is not None:
        out["agreement"] = {s: agreement(logits[ref], v, ref in probs, s in probs)
                            for s, v in logits.items() if s != ref}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--sides", default=None,
                    help="comma-separated, of: nanoserve, hf, vllm (default all; --smoke: "
                         "nanoserve,hf)")
    ap.add_argument("--rows", type=int, default=None, help="rows (default 100,000; --smoke 24)")
    ap.add_argument("--min-len", type=int, default=None,
                    help="shortest row in tokens (default 50; --smoke 8)")
    ap.add_argument("--max-len", type=int, default=None,
                    help="longest row in tokens (default 500; --smoke 40)")
    ap.add_argument("--warmup-rows", type=int, default=None,
                    help="the untimed warm-up's rows, another seed (default 1,024; --smoke 4)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="nanoserve: tokens per packed prefill (default 65,536; --smoke 128)")
    ap.add_argument("--hf-batch-size", type=int, default=None,
                    help="transformers: rows per padded batch (default 128; --smoke 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the models, the vLLM child's files and the results JSON "
                         "(default: a new temporary folder); models there are reused")
    ap.add_argument("--vllm-site", default="/tmp/vsite",
                    help="the vLLM child's whole PYTHONPATH (a `pip install --target` folder)")
    ap.add_argument("--vllm-with-tokenizer", action="store_true",
                    help="vLLM loads the folder's word-level tokenizer instead of "
                         "skip_tokenizer_init=True (rows still token ids): a fallback")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's")
    ap.add_argument("--vllm-timeout", type=float, default=1500,
                    help="seconds before the vLLM child is killed")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape of each on the CPU, float32, 24 short rows, "
                         "nanoserve and hf")
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_child:
        vllm_child(args.vllm_spec, args.vllm_result)
        return 0
    small = args.smoke
    for name, full, smoke in (("rows", 100_000, 24), ("min_len", 50, 8), ("max_len", 500, 40),
                              ("warmup_rows", 1024, 4), ("batch_tokens", 65536, 128),
                              ("hf_batch_size", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if small else full)
    shapes = [s for s in args.shapes.split(",") if s]
    sides = [s for s in (args.sides or ("nanoserve,hf" if small else ",".join(SIDES))).split(",")
             if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    for s in sides:
        if s not in SIDES:
            ap.error(f"unknown side {s!r}; choose from {', '.join(SIDES)}")
    if small and "vllm" in sides:
        ap.error("--smoke runs on the CPU: sides nanoserve and hf only")
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    if args.max_len > 512 and "encoder" in shapes:
        ap.error("the encoder (bert-base) holds 512 positions: --max-len 512 at most")
    if min(args.rows, args.warmup_rows, args.batch_tokens, args.hf_batch_size) < 1:
        ap.error("--rows, --warmup-rows, --batch-tokens and --hf-batch-size must be >= 1")

    import torch

    from benchmarks.common import git_commit

    device, dtype = ("cpu", "float32") if small else ("cuda", "bfloat16")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    work = args.out or Path(tempfile.mkdtemp(prefix="nanoserve-classify-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    print(f"commit {git_commit()}; {gpu or 'CPU'}; torch {torch.__version__}; {dtype}; sides "
          f"{', '.join(sides)}; nanoserve {args.batch_tokens:,} tokens a packed prefill, "
          f"transformers {args.hf_batch_size} rows a padded batch (sorted by length); "
          f"sentence-transformers' CrossEncoder not timed (the same transformers model behind "
          f"a tokenizer)", flush=True)
    results: dict = {"commit": git_commit(), "device": device, "gpu": gpu, "dtype": dtype,
                     "torch": torch.__version__, "smoke": small, "sides": sides,
                     "settings": {k: getattr(args, k) for k in
                                  ("rows", "min_len", "max_len", "warmup_rows", "batch_tokens",
                                   "hf_batch_size", "seed")},
                     "targets": TARGETS, "shapes": {}}
    for shape in shapes:
        results["shapes"][shape] = run_shape(shape, args, device, dtype, sides, work)
    print_table(results)
    path = work / f"classify{'_smoke' if small else ''}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
