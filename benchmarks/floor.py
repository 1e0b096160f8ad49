"""The serial floor of nano-vllm's workload on one GPU: a lower bound on the time of any engine
that runs a step's kernels one after another with cuBLAS's GEMMs, built from parts measured
on this GPU in the same call.

Workload: `benchmarks.gpu_job.make_workload` (256 rows, prompts and outputs uniform in
[100, 1024], seed 0), every row admitted at once (the engine's batch holds all 256). The
prefill gives each row its first token; a row of n output tokens then runs in decode steps
1 .. n-1, and at step s it reads its whole context (prompt + s tokens) in every layer.

    floor = prefill GEMMs + sum over decode steps of
            (layers x the four projections' GEMMs + LM head) at that step's rows
            + that step's K/V bytes / the GPU's read bandwidth

Measured here: the four projections of one layer (q/k/v, o, gate/up, down) and the LM head
per row count, each as calls inside one CUDA graph over weights of their own (read from
HBM, not L2), by cuBLAS (`F.linear`) in bf16 or `torch._scaled_mm` in FP8 (one scale per
tensor, fast accumulation: as `nanoserve.weights.fp8.Fp8Linear` runs them), interpolated between
the measured row counts; the prefill's projections at 8,192 rows a call; the read
bandwidth as a sum's over 4 GiB. Left out, so the floor is below what
any such engine can reach: the norms, rotary, SwiGLU, sampling, the attention's own
compute and latency, the prefill's attention and LM head, and all host time. A faster
engine has to overlap kernels (memory-bound attention beside compute-bound GEMMs).

The roofline rows put the GPU's datasheet peaks in place of the measured GEMMs: a step's
projections and LM head take max(their weights' bytes / the read bandwidth, their FLOPs /
the peak), the prefill its FLOPs / the peak (--peak-tflops: H200 dense bf16 989 and FP8
1,979 TFLOP/s by default; the LM head at the bf16 peak in both); the K/V reads as above.

A mixture-of-experts shape (`--shape qwen3-30b-a3b` or `mixtral-8x7b`) gets the roofline rows
alone (`moe_roofline_floor`): a decode step of r rows reads the attention projections, the
LM head and, in each layer, the weights of every expert its r rows route to (E (1 - (1 -
k/E)^r) of the E experts on average when each row picks k of them at random: at a few
hundred rows that is all of them), and computes the active FLOPs (the attention projections
and k experts a row) at the peak; the K/V reads as above; the prefill its active FLOPs at
the peak. Routing, the sort and the weighted sum are left out.

    python3 -m benchmarks.floor [--shape 8b|1b|qwen3-30b-a3b|mixtral-8x7b] [--kinds bf16 fp8] [--rows N] [--seed S]
        [--max-running R] [--pool-gib G] [--kv-dtype bf16|fp8] [--peak-tflops BF16 FP8]

A batch larger than the running set (issue 45's: `--rows 4096 --seed 7 --max-running 1024
--pool-gib G`): rows join in input order as others end, while fewer than R run and their
contexts fit the pool (`serial_floor`); the last column is the floor of an engine that runs
each decode step's attention beside its GEMMs (each step the longer of the two).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import markdown_table
from benchmarks.gpu_job import LLAMA_1B, LLAMA_8B
from benchmarks.moe import MIXTRAL_8X7B, QWEN3_30B_A3B
from benchmarks.vs_vllm import nanovllm_workload

SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}
MOE_SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B}
DECODE_ROWS = (1, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 384, 512, 768, 1024)
PREFILL_ROWS = 8192


@dataclass(frozen=True)
class Floor:
    prefill_s: float
    gemm_s: float  # decode steps: projections and LM head
    kv_s: float  # decode steps: K/V reads
    kv_bytes: float
    steps: int
    # decode steps with each step's K/V reads run beside its GEMMs: sum of max(the two)
    overlap_decode_s: float = 0.0
    max_rows: int = 0  # the most rows in one decode step

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.gemm_s + self.kv_s

    @property
    def overlap_s(self) -> float:
        """The floor of an engine that runs each step's attention beside its GEMMs."""
        return self.prefill_s + self.overlap_decode_s


def serial_floor(prompt_lens: Sequence[int], output_lens: Sequence[int], kv_bytes_per_token: float,
                 step_gemm_s: Callable[[int], float], read_bytes_per_s: float,
                 prefill_s: float, max_running: int | None = None,
                 pool_tokens: int | None = None) -> Floor:
    """The floor of the workload above. kv_bytes_per_token: K and V of one token over all
    layers; step_gemm_s(rows): a decode step's GEMMs (all layers and the LM head), seconds.

    max_running / pool_tokens (None: no bound): a batch larger than the running set. Rows
    join in input order before a step while fewer than max_running run and the contexts held
    plus the new row's prompt and first token fit pool_tokens (one row always joins an empty
    batch); a row of n output tokens runs n - 1 steps after it joins. No preemption is
    counted: rows that outgrow the pool are left to the engine."""
    p = np.asarray(prompt_lens, dtype=np.int64)
    n = np.asarray(output_lens, dtype=np.int64)
    cap = max_running or len(p)
    ctx = np.zeros(0, dtype=np.int64)  # the running rows' contexts at their next step
    left = np.zeros(0, dtype=np.int64)  # and their steps still to run
    gemm = kv_bytes = overlap = 0.0
    steps = most = 0
    nxt = 0
    while nxt < len(p) or len(ctx):
        joined_ctx, joined_left = [], []
        held = int(ctx.sum())
        while nxt < len(p) and len(ctx) + len(joined_ctx) < cap:
            need = int(p[nxt]) + 1
            if pool_tokens is not None and held + need > pool_tokens and (len(ctx) or joined_ctx):
                break
            if n[nxt] > 1:
                joined_ctx.append(need)
                joined_left.append(int(n[nxt]) - 1)
                held += need
            nxt += 1
        ctx = np.concatenate([ctx, np.asarray(joined_ctx, dtype=np.int64)])
        left = np.concatenate([left, np.asarray(joined_left, dtype=np.int64)])
        rows = len(ctx)
        if rows == 0:
            continue
        steps += 1
        most = max(most, rows)
        g = step_gemm_s(rows)
        b = float(ctx.sum()) * kv_bytes_per_token
        gemm += g
        kv_bytes += b
        overlap += max(g, b / read_bytes_per_s)
        ctx, left = ctx + 1, left - 1
        keep = left > 0
        ctx, left = ctx[keep], left[keep]
    return Floor(prefill_s, gemm, kv_bytes / read_bytes_per_s, kv_bytes, steps, overlap, most)


def _graph_time_s(fn: Callable[[], None], calls: int, replays: int = 7) -> float:
    """Seconds per call of fn (calls of it captured in one CUDA graph; median replay)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # cuBLAS picks and allocates its workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return float(np.median(times))


LAYER_GEMMS = ("qkv", "o", "gate_up", "down")


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def gemm_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of a layer's four projections (q/k/v and gate/up fused) and of the LM head."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = _head_dim(config)
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, config["num_attention_heads"] * d), "gate_up": (2 * i, h),
            "down": (h, i), "lm_head": (config["vocab_size"], h)}


def projection_params(config: dict) -> int:
    """Parameters of all layers' projections (the LM head not counted)."""
    shapes = gemm_shapes(config)
    return config["num_hidden_layers"] * sum(n * k for n, k in map(shapes.get, LAYER_GEMMS))


class _Gemms:
    """Weights of one layer's four projections (and of the LM head), made once each,
    `copies` of each so that consecutive calls read HBM; `time_s(name, rows)` per call."""

    def __init__(self, config: dict, kind: str, copies: int = 6) -> None:
        self.shapes = gemm_shapes(config)
        self.kind, self.copies = kind, copies
        self.unit = torch.ones((), device="cuda")
        self.weights: dict[str, list[torch.Tensor]] = {}

    def _weights(self, name: str) -> list[torch.Tensor]:
        if name not in self.weights:
            n, k = self.shapes[name]
            dtype = torch.float8_e4m3fn if self._fp8(name) else torch.bfloat16
            self.weights[name] = [
                (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).to(dtype)
                for _ in range(2 if name == "lm_head" else self.copies)]
        return self.weights[name]

    def _fp8(self, name: str) -> bool:
        return self.kind == "fp8" and name != "lm_head"  # the LM head stays bf16

    def time_s(self, name: str, rows: int) -> float:
        ws = self._weights(name)
        x = torch.randn(rows, self.shapes[name][1], device="cuda", dtype=torch.bfloat16)
        if self._fp8(name):
            from nanoserve.weights.fp8 import FAST_ACCUM

            xq = x.to(torch.float8_e4m3fn)
            calls = [lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=self.unit,
                                                  scale_b=self.unit, out_dtype=torch.bfloat16,
                                                  use_fast_accum=FAST_ACCUM) for w in ws]
        else:
            calls = [lambda w=w: F.linear(x, w) for w in ws]
        return _graph_time_s(lambda: [c() for c in calls], 1) / len(ws)


def read_bandwidth() -> float:
    """Bytes/s of a sum over 4 GiB."""
    big = torch.ones(2**31, device="cuda", dtype=torch.bfloat16)
    return 4 * 2**30 / _graph_time_s(lambda: big.sum(dtype=torch.float32), 4)


def roofline_floor(config: dict, kind: str, prompt_lens, output_lens, read_bytes_per_s: float,
                   peak_flops: dict[str, float], max_running: int | None = None,
                   pool_tokens: int | None = None, kv_bytes_per_token: int | None = None
                   ) -> Floor:
    """The floor with every GEMM at max(weight bytes / bandwidth, FLOPs / peak)."""
    proj = projection_params(config)
    head = config["vocab_size"] * config["hidden_size"]
    proj_bytes = proj * (1 if kind == "fp8" else 2)

    def step_s(rows: int) -> float:
        flops_s = 2 * rows * (proj / peak_flops[kind] + head / peak_flops["bf16"])
        return max((proj_bytes + 2 * head) / read_bytes_per_s, flops_s)

    return serial_floor(prompt_lens, output_lens, kv_bytes_per_token or _kv_bytes_per_token(config),
                        step_s, read_bytes_per_s, 2 * proj * sum(prompt_lens) / peak_flops[kind],
                        max_running, pool_tokens)


def moe_layout(config: dict) -> tuple[int, int, int]:
    """(experts E, experts a token routes to k, one expert's parameters 3 d I) of a Qwen3-MoE
    or Mixtral config (experts on every layer, no shared expert)."""
    experts = config.get("num_experts") or config["num_local_experts"]
    inner = config.get("moe_intermediate_size") or config["intermediate_size"]
    return experts, config["num_experts_per_tok"], 3 * config["hidden_size"] * inner


def experts_touched(rows: int, experts: int, top_k: int) -> float:
    """Distinct experts that `rows` rows route to, on average, when each picks top_k of the
    experts uniformly at random: E (1 - (1 - k/E)^rows)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def moe_roofline_floor(config: dict, kind: str, prompt_lens, output_lens,
                       read_bytes_per_s: float, peak_flops: dict[str, float],
                       max_running: int | None = None, pool_tokens: int | None = None,
                       kv_bytes_per_token: int | None = None) -> Floor:
    """The roofline floor of a MoE shape (module docstring): per step max(the bytes of the
    attention projections, the LM head and the experts touched / bandwidth, the active
    FLOPs / peak). FP8: projections and experts one byte a parameter, the LM head bf16."""
    layers = config["num_hidden_layers"]
    shapes = gemm_shapes(config)
    attn = layers * sum(n * k for n, k in (shapes["qkv"], shapes["o"]))
    experts, top_k, per_expert = moe_layout(config)
    head = config["vocab_size"] * config["hidden_size"]
    width = 1 if kind == "fp8" else 2
    active = attn + layers * top_k * per_expert  # parameters a token multiplies

    def step_s(rows: int) -> float:
        touched = layers * experts_touched(rows, experts, top_k) * per_expert
        weights = (attn + touched) * width + 2 * head
        flops_s = 2 * rows * (active / peak_flops[kind] + head / peak_flops["bf16"])
        return max(weights / read_bytes_per_s, flops_s)

    return serial_floor(prompt_lens, output_lens, kv_bytes_per_token or _kv_bytes_per_token(config),
                        step_s, read_bytes_per_s, 2 * active * sum(prompt_lens) / peak_flops[kind],
                        max_running, pool_tokens)


def _kv_bytes_per_token(config: dict, kv_dtype: str = "bf16") -> int:
    """K and V of one token over all layers, bf16 (or FP8: 1 byte an entry)."""
    per = 1 if kv_dtype == "fp8" else 2
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * _head_dim(config) * per


def measure(config: dict, kind: str, prompt_lens, output_lens, max_running: int | None = None,
            pool_tokens: int | None = None, kv_dtype: str = "bf16") -> tuple[Floor, dict]:
    gemms = _Gemms(config, kind)
    layers = config["num_hidden_layers"]
    per_rows = {r: layers * sum(gemms.time_s(g, r) for g in LAYER_GEMMS)
                + gemms.time_s("lm_head", r) for r in DECODE_ROWS}
    xs = np.array(DECODE_ROWS, dtype=np.float64)
    ys = np.array([per_rows[r] for r in DECODE_ROWS])
    prefill_token_s = layers * sum(gemms.time_s(g, PREFILL_ROWS) for g in LAYER_GEMMS) / PREFILL_ROWS
    del gemms
    torch.cuda.empty_cache()
    bw = read_bandwidth()
    floor = serial_floor(prompt_lens, output_lens, _kv_bytes_per_token(config, kv_dtype),
                         lambda r: float(np.interp(r, xs, ys)), bw,
                         prefill_token_s * sum(prompt_lens), max_running, pool_tokens)
    facts = {"per_rows": per_rows, "read_bw": bw,
             "prefill_tflops": 2 * projection_params(config) / prefill_token_s / 1e12}
    return floor, facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default="8b")
    ap.add_argument("--kinds", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    ap.add_argument("--rows", type=int, default=256,
                    help="the workload's rows (at most 1,024 without --max-running: one batch)")
    ap.add_argument("--seed", type=int, default=0, help="the workload's (batch4096's is 7)")
    ap.add_argument("--max-running", type=int, default=None,
                    help="the most rows running at once (1 to 1,024; default: all)")
    ap.add_argument("--pool-gib", type=float, default=None,
                    help="the KV pool's size: rows join only while their contexts fit it")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="the cache's entries: fp8 reads half the bytes and holds twice the "
                         "tokens of --pool-gib")
    ap.add_argument("--peak-tflops", type=float, nargs=2, default=[989.0, 1979.0],
                    metavar=("BF16", "FP8"), help="the roofline rows' dense peaks")
    args = ap.parse_args()
    if not 1 <= (args.max_running or args.rows) <= DECODE_ROWS[-1]:
        ap.error(f"at most {DECODE_ROWS[-1]} rows run at once: lower --rows or set --max-running")
    peaks = {"bf16": args.peak_tflops[0] * 1e12, "fp8": args.peak_tflops[1] * 1e12}
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.floor measures a GPU: no CUDA device here")
    moe = args.shape in MOE_SHAPES
    config = MOE_SHAPES[args.shape] if moe else SHAPES[args.shape]
    prompts, output_lens = nanovllm_workload(args.rows, config["vocab_size"], args.seed)
    prompt_lens = [len(p) for p in prompts]
    out_tokens = sum(output_lens)
    kv_token = _kv_bytes_per_token(config, args.kv_dtype)
    pool = int(args.pool_gib * 2**30 // kv_token) if args.pool_gib else None
    print(f"{args.shape} shape, {args.rows} rows (seed {args.seed}): {sum(prompt_lens):,} prompt "
          f"tokens, {out_tokens:,} output tokens; at most {args.max_running or args.rows} "
          f"running, pool {f'{pool:,} tokens' if pool else 'unbounded'}, {args.kv_dtype} cache")
    rows = []
    for kind in args.kinds:
        if moe:  # the roofline alone (module docstring)
            bw = read_bandwidth()
            f = moe_roofline_floor(config, kind, prompt_lens, output_lens, bw, peaks,
                                   args.max_running, pool, kv_token)
            print(f"{kind}: read bandwidth {bw / 1e12:.2f} TB/s")
            rows.append([f"{kind} roofline", f"{f.prefill_s:.2f}", f"{f.gemm_s:.2f}",
                         f"{f.kv_bytes / 1e12:.1f}", f"{f.kv_s:.2f}", str(f.steps),
                         str(f.max_rows), f"{f.total_s:.2f}", f"{out_tokens / f.total_s:,.0f}",
                         f"{out_tokens / f.overlap_s:,.0f}"])
            continue
        floor, facts = measure(config, kind, prompt_lens, output_lens, args.max_running, pool,
                               args.kv_dtype)
        print(f"\n{kind}: a decode step's GEMMs (all layers + LM head), us, by rows: "
              + ", ".join(f"{r}: {s * 1e6:,.0f}" for r, s in facts["per_rows"].items()))
        print(f"{kind}: prefill projections at {PREFILL_ROWS:,} rows: "
              f"{facts['prefill_tflops']:,.0f} TFLOP/s; read bandwidth "
              f"{facts['read_bw'] / 1e12:.2f} TB/s")
        roof = roofline_floor(config, kind, prompt_lens, output_lens, facts["read_bw"], peaks,
                              args.max_running, pool, kv_token)
        for label, f in ((kind, floor), (f"{kind} roofline", roof)):
            rows.append([label, f"{f.prefill_s:.2f}", f"{f.gemm_s:.2f}",
                         f"{f.kv_bytes / 1e12:.1f}", f"{f.kv_s:.2f}", str(f.steps),
                         str(f.max_rows), f"{f.total_s:.2f}", f"{out_tokens / f.total_s:,.0f}",
                         f"{out_tokens / f.overlap_s:,.0f}"])
    print()
    print(markdown_table(["floor", "prefill GEMMs s", "decode GEMMs s", "K/V read TB",
                          "K/V read s", "decode steps", "most rows", "floor s",
                          "output tok/s at the floor", "tok/s, attention beside GEMMs"],
                         rows))


if __name__ == "__main__":
    main()
