"""Qwen2.5-VL on one GPU: images in, short captions out; nanoserve against vLLM 0.26.0 on the
same rows, back to back in one session.

Shape: Qwen2.5-VL-3B-Instruct's configuration (`--shape 7b`: 7B's), random bf16 weights
drawn on the device by each engine (`load_format="dummy"`, no checkpoint on disk). The
model folder (`vl_folder`) holds config.json, the released preprocessor_config.json (the
Qwen2-VL image processor: 14-pixel patches, 2 x 2 merge, 3,136 to 12,845,056 pixels) and a
tokenizer: a word-level vocabulary over every id (`<t17>` is id 17) with Qwen2.5-VL's special
tokens at their ids, and Qwen2-VL's chat template (the default system prompt included).

Workload (`make_rows`, fixed seeds): `--rows` rows (2,000), each one user turn of one image
and an instruction of 8-16 vocabulary words; each row's output length uniform in [32, 128],
greedy, ignore_eos. The images (`make_images`) are generated smooth colour waves with a
little noise, saved as JPEG (quality 90) at sizes drawn from `SIZES` (224 x 224 to
1280 x 720: 64 to 1,196 image tokens each), written once under DIR/images and given to
both engines as `file://` image_url parts.

Each engine: an untimed warm-up over `--warmup-rows` rows of other images, then one timed
`chat` over all rows: reading and decoding the images, preprocessing, the vision tower,
prefill and decode, everything from the rows to their text. images/s = rows / wall; each
row must give exactly its max_tokens tokens. vLLM runs first, in a child process whose
PYTHONPATH is only --vllm-site (`LLM(model=DIR, load_format="dummy",
limit_mm_per_prompt={"image": 1}, allowed_local_media_path=DIR, max_model_len=4096,
gpu_memory_utilization=0.9)`, its defaults otherwise; `LLM.chat`); it exits and leaves the
GPU whole for nanoserve, in this process (`LLM(DIR, load_format="dummy")`, its defaults).
nanoserve's call is `LLM.chat`'s two steps timed apart: the prompts (images read, decoded
and patched on the host: `prepare_s`), then `generate`. Prints one table and writes
DIR/vl_<shape>.json.

    python3 -m benchmarks.vl [--shape 3b|7b] [--rows 2000] [--warmup-rows 64]
        [--sides vllm,nanoserve] [--out DIR] [--vllm-site /tmp/vsite]
    python3 -m benchmarks.vl --smoke

On one H200, after staging vLLM into /tmp/vsite (../shared/tools/stage-vllm.sh and its
three device calls; vLLM's Qwen2.5-VL processor imports torchvision, which must be in
that site or the machine's Python too):

    PYTHONPATH=$PWD python3 -m benchmarks.vl --shape 3b --rows 2000 --out /tmp/vl-bench \
        --vllm-site /tmp/vsite

--smoke: a 2-layer, narrow Qwen2.5-VL shape on the CPU, 4 small images, nanoserve only
(tests/test_bench_vl.py).

This module imports only the standard library at the top: the vLLM child runs this file
with vLLM's PYTHONPATH, and must import vllm before torch and never import nanoserve.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("vllm", "nanoserve")
VOCAB = 151936
SPECIAL_TOKENS = {  # Qwen2.5-VL's, at their ids
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656}
WORDS = 151643  # ids below the special tokens: the instructions' words
VISION = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
          "num_heads": 16, "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2,
          "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
          "tokens_per_second": 2, "temporal_patch_size": 2}
QWEN2_5_VL_3B = {  # config.json of Qwen2.5-VL-3B-Instruct (transformers 4.x layout)
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
    "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
    "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
    "use_sliding_window": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
    "vocab_size": VOCAB, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {**VISION, "out_hidden_size": 2048},
}
QWEN2_5_VL_7B = {**QWEN2_5_VL_3B, "hidden_size": 3584, "intermediate_size": 18944,
                 "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                 "tie_word_embeddings": False, "vision_config": {**VISION, "out_hidden_size": 3584}}
SMOKE = {**QWEN2_5_VL_3B, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
         "max_position_embeddings": 4096, "tie_word_embeddings": False,
         "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
         "vision_config": {**VISION, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "out_hidden_size": 64, "window_size": 56,
                           "fullatt_block_indexes": [1]}}
SHAPES = {"3b": QWEN2_5_VL_3B, "7b": QWEN2_5_VL_7B}
PREPROCESSOR = {  # preprocessor_config.json of Qwen2.5-VL-3B/7B-Instruct
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}
SIZES = ((224, 224), (336, 336), (448, 336), (512, 512), (640, 480), (800, 600),
         (1024, 768), (1280, 720))  # (width, height), drawn uniformly per image
MAX_MODEL_LEN = 4096  # the largest row: 1,196 image tokens + ~40 of text + 128 out


# --- the model folder and the rows ---------------------------------------------------------


def vl_folder(folder: Path, config: dict, preprocessor: dict = PREPROCESSOR) -> Path:
    """config.json, preprocessor_config.json and the word-level tokenizer (see the module
    docstring): what `load_format="dummy"` needs on both sides."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from nanoserve.testing import QWEN2_VL_CHAT_TEMPLATE

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    names = {i: t for t, i in SPECIAL_TOKENS.items()}
    vocab = {names.get(i, f"<t{i}>"): i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 131072,
        "chat_template": QWEN2_VL_CHAT_TEMPLATE}))
    return folder


def make_images(folder: Path, n: int, seed: int, sizes=SIZES) -> list[Path]:
    """n JPEGs (quality 90) at sizes drawn from `sizes`: smooth colour waves of random
    frequencies and phases plus a little noise, so they compress as photographs do. Files
    already there (same name: seed, index, size) are kept."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        w, h = rng.choice(sizes)
        path = folder / f"s{seed}-{i:05d}-{w}x{h}.jpg"
        params = [(rng.uniform(4, 40), rng.uniform(4, 40), rng.uniform(0, 6.3)) for _ in range(3)]
        if not path.exists():
            y, x = np.mgrid[0:h, 0:w].astype(np.float32)
            noise = np.random.default_rng(seed * 100003 + i).normal(0, 6, (h, w, 3))
            waves = [127 + 110 * np.sin(x / fx + y / fy + ph) for fx, fy, ph in params]
            pixels = np.clip(np.stack(waves, -1) + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(path, "JPEG", quality=90)
        paths.append(path)
    return paths


def make_rows(images: list[Path], seed: int, lo: int = 32, hi: int = 128
              ) -> tuple[list[list[dict]], list[int]]:
    """One conversation per image (a user turn: the image as a `file://` image_url part, then
    8-16 vocabulary words) and each row's output length, uniform in [lo, hi]."""
    rng = random.Random(seed)
    rows, max_tokens = [], []
    for path in images:
        words = " ".join(f"<t{rng.randrange(1, WORDS)}>" for _ in range(rng.randint(8, 16)))
        rows.append([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"file://{path.resolve()}"}},
            {"type": "text", "text": words}]}])
        max_tokens.append(rng.randint(lo, hi))
    return rows, max_tokens


# --- nanoserve, in this process -------------------------------------------------------------


def run_nanoserve(model_dir: Path, rows: list, max_tokens: list[int], warm: tuple,
                  device: str) -> dict:
    """The warm-up, then `LLM.chat`'s two steps timed (see the module docstring)."""
    import torch

    from nanoserve.llm import LLM
    from nanoserve.multimodal.prompt import chat_prompt
    from nanoserve.sampling.params import SamplingParams

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t = time.perf_counter()
    llm = LLM(str(model_dir), device=device, load_format="dummy")
    sync()
    side = {"load_s": time.perf_counter() - t, "kv_pool_tokens": llm.pool.num_tokens,
            "max_batch_size": llm.max_batch_size}
    print(f"nanoserve loaded in {side['load_s']:.1f} s: KV pool {llm.pool.num_tokens:,} "
          f"tokens, at most {llm.max_batch_size} rows running", flush=True)

    def params(lengths):
        return [SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths]

    llm.chat(warm[0], params(warm[1]))
    sync()
    t0 = time.perf_counter()
    prompts = [chat_prompt(llm.tokenizer, llm.config.image_token_id, llm.image_config, c)
               for c in rows]
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params(max_tokens))
    sync()
    t2 = time.perf_counter()
    if [len(o.token_ids) for o in outs] != list(max_tokens):
        raise SystemExit("nanoserve: rows did not give exactly their max_tokens")
    st = llm.last_stats
    side.update(wall_s=t2 - t0, prepare_s=t1 - t0, generate_s=t2 - t1,
                prompt_tokens=sum(len(p.token_ids) for p in prompts),
                output_tokens=sum(max_tokens), images_s=len(rows) / (t2 - t0),
                tok_s=sum(max_tokens) / (t2 - t0), preemptions=st.preemptions,
                rows_per_step=st.decode_row_steps / max(1, st.decode_steps))
    print(f"nanoserve: {side['wall_s']:.2f} s ({side['prepare_s']:.2f} s preparing prompts), "
          f"{side['images_s']:.1f} images/s, {side['tok_s']:.0f} output tok/s", flush=True)
    del llm, prompts
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return side


# --- vLLM, in a child process ---------------------------------------------------------------


def run_vllm(model_dir: Path, rows: list, max_tokens: list[int], warm: tuple, work: Path,
             args) -> tuple[dict | None, str]:
    """Runs this file with --vllm-child under vLLM's environment; (results or None, error)."""
    from benchmarks.vs_vllm import launch_vllm_child  # not at the top: the child has no repo

    spec = {"model": str(model_dir), "max_model_len": MAX_MODEL_LEN,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "allowed_local_media_path": str(work.resolve()), "rows": rows,
            "max_tokens": max_tokens, "warm_rows": warm[0], "warm_max_tokens": warm[1]}
    rc, result, tail = launch_vllm_child(Path(__file__), spec, work, "vllm_vl", args)
    if rc == 0 and result and "wall_s" in result:
        return result, ""
    return result, f"vLLM child failed (exit {rc}); last 40 lines of its stderr:\n{tail}"


def vllm_child(spec_path: Path, result_path: Path) -> None:
    """In the child: vLLM first (no torch, no nanoserve before it)."""
    import vllm
    from vllm import LLM, SamplingParams

    spec = json.loads(spec_path.read_text())
    t = time.perf_counter()
    llm = LLM(model=spec["model"], load_format="dummy", limit_mm_per_prompt={"image": 1},
              allowed_local_media_path=spec["allowed_local_media_path"],
              max_model_len=spec["max_model_len"],
              gpu_memory_utilization=spec["gpu_memory_utilization"])
    result = {"vllm_version": vllm.__version__, "load_s": time.perf_counter() - t}
    try:  # what vLLM chose by default, for the record
        cfg = llm.llm_engine.vllm_config
        result.update(dtype=str(cfg.model_config.dtype),
                      max_num_seqs=cfg.scheduler_config.max_num_seqs,
                      max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                      kv_blocks=cfg.cache_config.num_gpu_blocks)
    except Exception as e:  # noqa: BLE001 - only the record is lost
        result["config_error"] = repr(e)

    def chat(engine, rows, lengths):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
        return engine.chat(rows, params, use_tqdm=False)

    chat(llm, spec["warm_rows"], spec["warm_max_tokens"])
    rows, max_tokens = spec["rows"], spec["max_tokens"]
    t = time.perf_counter()
    outs = chat(llm, rows, max_tokens)  # finished outputs: nothing left in flight
    wall = time.perf_counter() - t
    lens = [len(o.outputs[0].token_ids) for o in outs]
    if lens != max_tokens:
        raise SystemExit("vLLM: rows did not give exactly their max_tokens")
    result.update(wall_s=wall, output_tokens=sum(lens), images_s=len(rows) / wall,
                  tok_s=sum(lens) / wall,
                  prompt_tokens=sum(len(o.prompt_token_ids) for o in outs))
    print(f"vLLM: {wall:.2f} s, {len(rows) / wall:.1f} images/s, {sum(lens) / wall:.0f} "
          f"output tok/s", flush=True)
    result_path.write_text(json.dumps(result, indent=1))
    del llm
    gc.collect()


# --- the table ------------------------------------------------------------------------------


def print_table(shape: str, rows: int, sides: dict) -> None:
    ref = sides.get("vllm")
    print("\n| shape | rows | side | wall s | images/s | output tok/s | prompt tokens | "
          "images/s over vLLM |")
    print("|---|---|---|---|---|---|---|---|")
    for name in SIDES:
        r = sides.get(name)
        if not r or "wall_s" not in r:
            continue
        ratio = f"{r['images_s'] / ref['images_s']:.2f}x" if ref and "wall_s" in ref else "n/a"
        print(f"| {shape} | {rows} | {name} | {r['wall_s']:.2f} | {r['images_s']:.1f} | "
              f"{r['tok_s']:.0f} | {r['prompt_tokens']} | {ratio} |")
    ours = sides.get("nanoserve")
    if ours and "prepare_s" in ours:
        print(f"nanoserve: {ours['prepare_s']:.2f} s of {ours['wall_s']:.2f} s preparing "
              f"prompts (images read, decoded, patched), {ours['generate_s']:.2f} s generating")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--warmup-rows", type=int, default=64)
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated: vllm, nanoserve")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's")
    ap.add_argument("--vllm-timeout", type=float, default=3000)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, nanoserve")
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_child:
        vllm_child(args.vllm_spec, args.vllm_result)
        return
    sides = [s for s in args.sides.split(",") if s]
    for s in sides:
        if s not in SIDES:
            ap.error(f"unknown side {s!r}; choose from {', '.join(SIDES)}")
    work = args.out or Path(tempfile.mkdtemp(prefix="nanoserve-vl-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    device, shape, config, preprocessor, sizes = "cuda", args.shape, SHAPES[args.shape], \
        PREPROCESSOR, SIZES
    if args.smoke:
        device, shape, config, sides = "cpu", "smoke", SMOKE, ["nanoserve"]
        preprocessor = {**PREPROCESSOR, "max_pixels": 28 * 28 * 16}
        sizes, args.rows, args.warmup_rows = ((56, 56), (112, 84)), 4, 2
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    model_dir = vl_folder(work / f"qwen2.5-vl-{shape}-dummy", config, preprocessor)
    lo, hi = (32, 128) if not args.smoke else (4, 8)
    rows, max_tokens = make_rows(make_images(work / "images", args.rows, 0, sizes), 1, lo, hi)
    warm = make_rows(make_images(work / "images", args.warmup_rows, 1, sizes), 2, lo, hi)
    print(f"{len(rows)} rows, one image each ({args.warmup_rows} more to warm up), "
          f"{sum(max_tokens)} output tokens", flush=True)
    result = {"shape": shape, "rows": len(rows), "device": device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "sides": {}}
    if "vllm" in sides:  # first: its child exits and leaves the GPU whole
        result["sides"]["vllm"], error = run_vllm(model_dir, rows, max_tokens, warm, work, args)
        if error:
            result["vllm_error"] = error
            print(error, flush=True)
    if "nanoserve" in sides:
        result["sides"]["nanoserve"] = run_nanoserve(model_dir, rows, max_tokens, warm, device)
    path = work / f"vl_{shape}.json"
    path.write_text(json.dumps(result, indent=2))
    print_table(shape, len(rows), result["sides"])
    print(f"results: {path}", flush=True)


if __name__ == "__main__":
    main()
