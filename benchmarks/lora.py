"""Many fine-tunes in one batch on one GPU: the Llama-3.1-8B shape (random bf16 weights drawn on
the device, `load_format="dummy"` on both sides) on 4,096 rows of nano-vllm's distribution
(prompt and output lengths uniform in [100, 1024], seed 0; greedy, ignore_eos, token ids),
the rows spread over 8 random rank-16 LoRA adapters on all seven projections (row i under
adapter i % 8), against the same rows on the base model; nanoserve and vLLM 0.26.0 back to
back.

    python3 -m benchmarks.lora [--runs vllm-base,vllm-lora,base,lora] [--rows 4096]
        [--warmup-rows 512] [--adapters 8] [--rank 16] [--out DIR] [--vllm-site /tmp/vsite]
    python3 -m benchmarks.lora --smoke

The adapters are PEFT folders (adapter_config.json, adapter_model.safetensors: A ~ N(0, 1/in),
B ~ N(0, 0.01^2), lora_alpha 32) written once into DIR/adapters. vLLM runs first, in a child
process with only --vllm-site on its PYTHONPATH (`benchmarks.vs_vllm.launch_vllm_child`):
`LLM(..., enable_lora=True, max_loras=8, max_lora_rank=16)` with a `LoRARequest` per row
(`vllm-lora`), and the base rows on a plain engine (`vllm-base`); then nanoserve in this
process: `LLM(load_format="dummy")` (`base`) and `LLM(..., lora={name: folder}, max_loras=8)`
with `generate(..., lora=[...])` (`lora`). Each engine first runs an untimed warm-up over the
first --warmup-rows rows (other token ids, same lengths and adapters). Writes
DIR/lora_<shape>_<runs>.json and prints one table (wall time, output tok/s, LoRA over base
on the same engine, ours over vLLM's) over every run whose results are in DIR, so runs too
long for one command can go in separate calls with the same --out.

--smoke: a 2-layer narrow shape on the CPU, a few short rows over 3 rank-4 adapters,
nanoserve's two runs only (tests/test_bench_lora.py).

This module imports only the standard library at the top: the vLLM child runs this file with
vLLM's PYTHONPATH, and must import vllm before torch and never import nanoserve.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

RUNS = ("vllm-base", "vllm-lora", "base", "lora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_names(count: int) -> list[str]:
    return [f"ft{i}" for i in range(count)]


def row_adapters(rows: int, names: list[str]) -> list[str]:
    """Row i runs under adapter i % len(names): every batch mixes all of them."""
    return [names[i % len(names)] for i in range(rows)]


def write_adapters(folder: Path, config: dict, count: int, rank: int, device: str) -> dict:
    """`count` random PEFT LoRA folders for `config`'s shape (every layer, all seven
    projections, rank `rank`), drawn on `device`, saved bf16; reused when complete.
    {name: folder}."""
    import torch
    from safetensors.torch import save_file

    d, inner = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
              "gate_proj": (inner, d), "up_proj": (inner, d), "down_proj": (d, inner)}
    out = {}
    for i, name in enumerate(adapter_names(count)):
        path = folder / name
        out[name] = path
        if (path / ".complete").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        g = torch.Generator(device=device).manual_seed(1000 + i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for t in TARGETS:
                where = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                stem = f"base_model.model.model.layers.{layer}.{where}.{t}"
                n_out, n_in = shapes[t]
                a = torch.randn(rank, n_in, generator=g, device=device) / n_in ** 0.5
                b = 0.01 * torch.randn(n_out, rank, generator=g, device=device)
                tensors[f"{stem}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
                tensors[f"{stem}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
            "target_modules": list(TARGETS), "base_model_name_or_path": None,
            "fan_in_fan_out": False, "modules_to_save": None, "inference_mode": True}, indent=1))
        (path / ".complete").write_text("")
    return out


# --- nanoserve, in this process ----------------------------------------------------------------


def run_nanoserve(model_dir: Path, prompts, max_tokens, adapters: dict | None, lora, device,
                  vocab: int, warmup_rows: int) -> dict:
    """One engine (with `adapters` or none): an untimed warm-up over the first rows, then
    the timed whole; every row must give exactly its max_tokens."""
    import torch

    from benchmarks.vs_vllm import warmup_of
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t = time.perf_counter()
    llm = LLM(str(model_dir), device=device, scheduler="continuous", load_format="dummy",
              **({"lora": adapters, "max_loras": len(adapters)} if adapters else {}))
    sync()
    side = {"load_s": time.perf_counter() - t, "max_batch_size": llm.max_batch_size,
            "adapters": len(adapters or {})}
    n = warmup_rows
    llm.generate(warmup_of(prompts[:n], vocab), [SamplingParams(max_tokens=m, ignore_eos=True)
                                                 for m in max_tokens[:n]],
                 lora=lora[:n] if lora else None)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, lora=lora)
    sync()
    wall = time.perf_counter() - t
    lens = [len(o.token_ids) for o in outs]
    if lens != list(max_tokens):
        raise SystemExit("nanoserve: rows did not give exactly their max_tokens")
    st = llm.last_stats
    side.update(wall_s=wall, output_tokens=sum(lens), tok_s=sum(lens) / wall,
                rows_per_step=st.decode_row_steps / max(1, st.decode_steps),
                preemptions=st.preemptions)
    if llm.adapters is not None:
        side["adapter_loads"] = llm.adapters.loads
    print(f"nanoserve {'lora' if adapters else 'base'}: {wall:.2f} s, {side['tok_s']:.0f} "
          f"output tok/s, {side['rows_per_step']:.0f} rows a decode step", flush=True)
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return side


# --- vLLM, in a child process ------------------------------------------------------------------


def vllm_child(spec_path: Path, result_path: Path) -> None:
    """In the child: vLLM first (no torch, no nanoserve before it); one engine, base or with
    LoRA as the spec says."""
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm import TokensPrompt
    except ImportError:
        from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    spec = json.loads(spec_path.read_text())
    adapters = spec["adapters"]
    t = time.perf_counter()
    extra = ({"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": spec["rank"]}
             if adapters else {})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enable_prefix_caching=True,
              gpu_memory_utilization=spec["gpu_memory_utilization"],
              max_model_len=spec["max_model_len"], load_format="dummy", **extra)
    result = {"vllm_version": vllm.__version__, "load_s": time.perf_counter() - t}
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in
                enumerate(adapters.items())}

    def generate(prompts, max_tokens, lora):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False)
                  for m in max_tokens]
        rows = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        per_row = [requests[n] for n in lora] if lora else None
        return llm.generate(rows, params, lora_request=per_row, use_tqdm=False)

    prompts, max_tokens, lora = spec["prompts"], spec["max_tokens"], spec["lora"]
    n, vocab = spec["warmup_rows"], spec["vocab"]
    generate([[(t + 1) % vocab for t in p] for p in prompts[:n]], max_tokens[:n],
             lora[:n] if lora else None)
    t = time.perf_counter()
    outs = generate(prompts, max_tokens, lora)
    wall = time.perf_counter() - t
    lens = [len(o.outputs[0].token_ids) for o in outs]
    if lens != list(max_tokens):
        raise SystemExit("vLLM: rows did not give exactly their max_tokens")
    result.update(wall_s=wall, output_tokens=sum(lens), tok_s=sum(lens) / wall)
    print(f"vLLM {'lora' if adapters else 'base'}: {wall:.2f} s, {result['tok_s']:.0f} output "
          f"tok/s", flush=True)
    result_path.write_text(json.dumps(result, indent=1))


def run_vllm(model_dir: Path, prompts, max_tokens, adapters: dict | None, lora, work: Path,
             args, stem: str) -> tuple[dict | None, str]:
    from benchmarks.vs_vllm import launch_vllm_child

    need = max(len(p) + m for p, m in zip(prompts, max_tokens))
    spec = {"model": str(model_dir), "vocab": args.vocab, "rank": args.rank,
            "max_model_len": max(4096, -(-need // 256) * 256),
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "adapters": {n: str(p) for n, p in (adapters or {}).items()},
            "prompts": prompts, "max_tokens": max_tokens, "lora": lora,
            "warmup_rows": args.warmup_rows}
    rc, result, tail = launch_vllm_child(Path(__file__), spec, work, stem, args)
    if rc == 0 and result:
        return result, ""
    return result, f"vLLM child failed (exit {rc}); last 40 lines of its stderr:\n{tail}"


# --- the table ---------------------------------------------------------------------------------


def print_table(sides: dict) -> None:
    def rate(run):
        return (sides.get(run) or {}).get("tok_s")

    def over(run, ref):
        return f"{rate(run) / rate(ref):.2f}x" if rate(run) and rate(ref) else ""

    print("\n| run | wall s | output tok/s | LoRA / base | ours / vLLM |")
    print("|---|---|---|---|---|")
    for run in RUNS:
        r = sides.get(run)
        if not r or "tok_s" not in r:
            continue
        engine, kind = ("vllm", run[5:]) if run.startswith("vllm-") else ("ours", run)
        vs_base = over(run, "vllm-base" if engine == "vllm" else "base") if kind == "lora" else ""
        vs_vllm = over(run, f"vllm-{kind}") if engine == "ours" else ""
        print(f"| {run} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | {vs_base} | {vs_vllm} |")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated, of: " + ", ".join(RUNS))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--warmup-rows", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's")
    ap.add_argument("--vllm-timeout", type=float, default=3000)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, ours only")
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_child:
        vllm_child(args.vllm_spec, args.vllm_result)
        return
    runs = [r for r in args.runs.split(",") if r]
    for r in runs:
        if r not in RUNS:
            ap.error(f"unknown run {r!r}; choose from {', '.join(RUNS)}")
    import torch

    from benchmarks.gpu_job import LLAMA_8B
    from benchmarks.vs_vllm import config_folder, nanovllm_workload

    device, config, shape, lo, hi = "cuda", LLAMA_8B, "8b", 100, 1024
    if args.smoke:
        device, shape, lo, hi, runs = "cpu", "smoke", 4, 12, ["base", "lora"]
        config = {**LLAMA_8B, "num_hidden_layers": 2, "hidden_size": 128,
                  "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 32, "vocab_size": 4096}
        args.rows, args.warmup_rows, args.adapters, args.rank = 6, 2, 3, 4
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    args.vocab = config["vocab_size"]
    work = args.out or Path(tempfile.mkdtemp(prefix="nanoserve-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = config_folder(work / f"llama-{shape}-dummy", config)
    adapters = write_adapters(work / f"adapters-{shape}-r{args.rank}", config, args.adapters,
                              args.rank, device)
    prompts, max_tokens = nanovllm_workload(args.rows, args.vocab, lo=lo, hi=hi)
    lora = row_adapters(args.rows, list(adapters))
    print(f"{len(prompts)} rows over {len(adapters)} rank-{args.rank} adapters, "
          f"{sum(map(len, prompts))} prompt tokens, {sum(max_tokens)} output tokens", flush=True)
    result = {"shape": shape, "rows": args.rows, "adapters": len(adapters), "rank": args.rank,
              "device": device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "sides": {}}
    for run in ("vllm-base", "vllm-lora"):  # first: each child exits, the GPU left whole
        if run in runs:
            with_lora = run == "vllm-lora"
            side, error = run_vllm(model_dir, prompts, max_tokens, adapters if with_lora else None,
                                   lora if with_lora else None, work, args, run.replace("-", "_"))
            result["sides"][run] = side
            if error:
                result[f"{run}_error"] = error
                print(error, flush=True)
    for run in ("base", "lora"):
        if run in runs:
            with_lora = run == "lora"
            result["sides"][run] = run_nanoserve(
                model_dir, prompts, max_tokens, adapters if with_lora else None,
                lora if with_lora else None, device, args.vocab, args.warmup_rows)
    stem = f"lora_{shape}"
    path = work / f"{stem}_{'_'.join(runs).replace('-', '_')}.json"
    path.write_text(json.dumps(result, indent=2))
    sides = {}
    for earlier in sorted(work.glob(f"{stem}_*.json"), key=lambda p: p.stat().st_mtime):
        sides.update({k: v for k, v in json.loads(earlier.read_text())["sides"].items() if v})
    print_table(sides)
    print(f"results: {path}", flush=True)


if __name__ == "__main__":
    main()
