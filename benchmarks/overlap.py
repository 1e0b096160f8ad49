"""Can a decode step's attention run beside its GEMMs on one GPU? A layer's work at batch
scale, timed one after the other and on two streams at once.

At 512-1,024 running rows of an 8B model a decode step's projections are compute-bound
(its FLOPs outlast the weights' read) and its attention is bound by the K/V read (128 KiB
a context token at this shape). An engine that splits the running rows into two halves can
run one half's attention beside the other half's projections, layer after layer (the other
half's q/k/v are ready one layer ahead): each layer then takes about the longer of the
two, not their sum (`benchmarks/floor.py`'s last column). This measures what the GPU gives
of that, with the engine's own kernels (cuBLAS `F.linear` in bf16, the Triton paged decode
attention), each case captured in one CUDA graph of `--layers` layers (weights of their own
per layer, so they come from HBM):

- serial: per layer, the four projections (q/k/v, o, gate/up, down) of R rows, then the
  attention of R rows over their contexts;
- two streams: per layer twice, the projections of R/2 rows on one stream beside the
  attention of the other R/2 rows on a second, joined before the next pair.

With `--carveout N ...` the two-stream case is also timed with cuBLAS's GEMMs held to all
but N multiprocessors (`torch._C._set_sm_carveout_experimental`, set while the case is
captured): the GEMMs then leave room for the attention beside them instead of taking every
multiprocessor. With `--green G ...` the GPU is cut in two (CUDA green contexts,
`benchmarks/sm_partition.py`): the GEMMs run on a stream of G multiprocessors and the
attention on a stream of the rest, each case also timed alone on its part, and the two
streams' case both captured and launched op by op (whether a graph keeps the partition).
`--prefill-tokens T` also times, per layer, a prefill's projections of T tokens beside
every row's decode attention (the overlap chunked prefill would give: a step's admitted
prompt tokens through the GEMMs while the running rows' K/V are read), on two streams and
on each green split. `--dtype fp8` times FP8 weights (`torch._scaled_mm`) over an FP8 cache.

    python3 -m benchmarks.overlap [--rows 256 512 1024] [--context 850] [--layers 8]
                                  [--carveout 0 32 48] [--green 48 64] [--prefill-tokens 1024]
                                  [--dtype bf16 fp8]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import markdown_table
from benchmarks.floor import LAYER_GEMMS, SHAPES, _graph_time_s, gemm_shapes


def _graph_us(fn) -> float:
    """Microseconds per replay of fn captured in one CUDA graph (median)."""
    return _graph_time_s(fn, 1) * 1e6


class Layers:
    """`layers` layers' projection weights and a KV pool holding `rows` rows of `context`
    tokens each (block size 16), with each half's queries and block tables."""

    def __init__(self, config: dict, layers: int, rows: int, context: int,
                 dtype: str = "bf16", tokens: int = 0) -> None:
        from nanoserve_kernels.backend import decode_attention

        self.attend = decode_attention
        self.fp8 = dtype == "fp8"
        store = torch.float8_e4m3fn if self.fp8 else torch.bfloat16  # weights, K/V, GEMM inputs
        self.one = torch.ones((), device="cuda")
        shapes = gemm_shapes(config)
        self.w = [{g: (torch.randn(*shapes[g], device="cuda") * 0.02).to(store)
                   for g in LAYER_GEMMS} for _ in range(layers)]
        self.h, self.i = config["hidden_size"], config["intermediate_size"]
        d = config.get("head_dim") or self.h // config["num_attention_heads"]
        self.hq, self.hkv, self.d = config["num_attention_heads"], config["num_key_value_heads"], d
        bs = 16
        per_row = -(-context // bs)
        self.k = torch.randn(rows * per_row, bs, self.hkv, d, device="cuda").to(store)
        self.v = torch.randn(rows * per_row, bs, self.hkv, d, device="cuda").to(store)
        self.tables = torch.arange(rows * per_row, device="cuda", dtype=torch.int32).view(rows, per_row)
        self.lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
        self.q = torch.randn(rows, self.hq, d, device="cuda", dtype=torch.bfloat16)
        self.x = torch.randn(max(rows, tokens), self.h, device="cuda").to(store)
        self.mid = torch.randn(max(rows, tokens), self.i, device="cuda").to(store)
        self.scale = d ** -0.5
        self.context = context

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> None:
        if self.fp8:  # unit scales, as the engine's FP8 GEMMs (scales applied after)
            torch._scaled_mm(x, w.t(), scale_a=self.one, scale_b=self.one,
                             out_dtype=torch.bfloat16)
        else:
            F.linear(x, w)

    def gemms(self, layer: int, lo: int, hi: int) -> None:
        w, x = self.w[layer], self.x[lo:hi]
        self._linear(x, w["qkv"])
        self._linear(x, w["o"])
        self._linear(x, w["gate_up"])
        self._linear(self.mid[lo:hi], w["down"])

    def attention(self, lo: int, hi: int) -> None:
        self.attend(self.q[lo:hi], self.k, self.v, self.tables[lo:hi], self.lens[lo:hi],
                    self.scale, max_context_len=self.context, even_splits=True)


def _carved_us(carveout: int, fn) -> float:
    """`_graph_us(fn)` with cuBLAS held to all but `carveout` multiprocessors while fn is
    captured (0: all of them); the carveout is a global setting, cleared after."""
    torch._C._set_sm_carveout_experimental(carveout or None)
    try:
        return _graph_us(fn)
    finally:
        torch._C._set_sm_carveout_experimental(None)


def _eager_us(fn, replays: int = 7) -> float:
    """Microseconds per call of fn launched op by op (median of `replays`, after one)."""
    fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(sorted(times)[len(times) // 2])


def _on(stream, fn):
    """fn run on `stream`, ordered after and joined back into the current stream."""
    def run() -> None:
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
        main.wait_stream(stream)
    return run


def measure(config: dict, rows: int, context: int, layers: int, carveouts: list[int],
            dtype: str = "bf16", greens: tuple[int, ...] = (), tokens: int = 0
            ) -> dict[str, float]:
    m = Layers(config, layers, rows, context, dtype, tokens)
    half = rows // 2
    streams = {"gemms": torch.cuda.Stream(), "attention": torch.cuda.Stream()}

    def serial() -> None:
        for layer in range(layers):
            m.gemms(layer, 0, rows)
            m.attention(0, rows)

    def gemms_only() -> None:
        for layer in range(layers):
            m.gemms(layer, 0, rows)

    def attention_only() -> None:
        for _ in range(layers):
            m.attention(0, rows)

    def beside(gemms: tuple[int, int, int], attention: tuple[int, int]) -> None:
        """m.gemms(*gemms) on the GEMM stream beside m.attention(*attention) on the other,
        both joined back into the current stream."""
        main = torch.cuda.current_stream()
        for stream, work, args in ((streams["gemms"], m.gemms, gemms),
                                   (streams["attention"], m.attention, attention)):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                work(*args)
        main.wait_stream(streams["gemms"])
        main.wait_stream(streams["attention"])

    def two_streams() -> None:
        for layer in range(layers):
            # the projections of one half beside the attention of the other, then the reverse
            for (a, b), (c, d) in (((0, half), (half, rows)), ((half, rows), (0, half))):
                beside((layer, a, b), (c, d))

    def prefill_gemms() -> None:
        for layer in range(layers):
            m.gemms(layer, 0, tokens)

    def prefill_then_attention() -> None:
        for layer in range(layers):
            m.gemms(layer, 0, tokens)
            m.attention(0, rows)

    def prefill_beside_attention() -> None:
        # a prefill's projections of `tokens` tokens beside every row's decode attention
        for layer in range(layers):
            beside((layer, 0, tokens), (0, rows))

    cases = [("gemms", gemms_only), ("attention", attention_only), ("serial", serial)]
    if tokens:
        cases += [("pf_gemms", prefill_gemms), ("pf_serial", prefill_then_attention),
                  ("pf_two_streams", prefill_beside_attention)]
    out = {name: _graph_us(fn) / layers for name, fn in cases}
    for c in carveouts:
        out[f"gemms_c{c}"] = _carved_us(c, gemms_only) / layers
        out[f"two_streams_c{c}"] = _carved_us(c, two_streams) / layers
    if greens:
        from benchmarks.sm_partition import split
    for g in greens:
        gemm_stream, attn_stream, (n_gemm, _) = split(g)
        out[f"sms_g{g}"] = n_gemm
        out[f"gemms_g{g}"] = _graph_us(_on(gemm_stream, gemms_only)) / layers
        out[f"attention_g{g}"] = _graph_us(_on(attn_stream, attention_only)) / layers
        streams.update(gemms=gemm_stream, attention=attn_stream)
        out[f"two_streams_g{g}"] = _graph_us(two_streams) / layers
        out[f"two_streams_eager_g{g}"] = _eager_us(two_streams) / layers
        out[f"gemms_eager_g{g}"] = _eager_us(_on(gemm_stream, gemms_only)) / layers
        if tokens:
            out[f"pf_gemms_g{g}"] = _graph_us(_on(gemm_stream, prefill_gemms)) / layers
            out[f"pf_two_streams_g{g}"] = _graph_us(prefill_beside_attention) / layers
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--context", type=int, default=850,
                    help="each row's context tokens (batch4096's rows average ~850 mid-way)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--carveout", type=int, nargs="+", default=[0],
                    help="multiprocessors kept from cuBLAS in the two-stream case (0: none)")
    ap.add_argument("--green", type=int, nargs="+", default=[],
                    help="also cut the GPU in two: the GEMMs on G multiprocessors, the "
                         "attention on the rest (CUDA green contexts)")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="also time a prefill's projections of this many tokens beside every "
                         "row's decode attention (chunked prefill's overlap)")
    ap.add_argument("--dtype", nargs="+", choices=("bf16", "fp8"), default=["bf16"],
                    help="fp8: FP8 weights (torch._scaled_mm) over an FP8 cache")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.overlap measures a GPU: no CUDA device here")
    config = SHAPES[args.shape]
    table, green, prefill = [], [], []
    T = args.prefill_tokens
    for dtype in args.dtype:
        for rows in args.rows:
            r = measure(config, rows, args.context, args.layers, args.carveout, dtype,
                        tuple(args.green), T)
            torch.cuda.empty_cache()  # (the last size's pool and weights)
            ideal = max(r["gemms"], r["attention"])
            for c in args.carveout:
                two = r[f"two_streams_c{c}"]
                table.append([dtype, str(rows), str(c), f"{r['gemms']:.0f}",
                              f"{r[f'gemms_c{c}']:.0f}", f"{r['attention']:.0f}",
                              f"{r['serial']:.0f}", f"{two:.0f}", f"{ideal:.0f}",
                              f"{r['serial'] / two:.2f}x"])
            for g in args.green:
                two = r[f"two_streams_g{g}"]
                green.append([dtype, str(rows), f"{r[f'sms_g{g}']}", f"{r['gemms']:.0f}",
                              f"{r[f'gemms_g{g}']:.0f}", f"{r[f'gemms_eager_g{g}']:.0f}",
                              f"{r['attention']:.0f}", f"{r[f'attention_g{g}']:.0f}",
                              f"{r['serial']:.0f}", f"{two:.0f}",
                              f"{r[f'two_streams_eager_g{g}']:.0f}",
                              f"{r['serial'] / two:.2f}x"])
            for g in [0] + args.green if T else []:
                two = r["pf_two_streams" + (f"_g{g}" if g else "")]
                prefill.append([dtype, str(rows), str(T), str(r[f"sms_g{g}"]) if g else "all",
                                f"{r['pf_gemms']:.0f}",
                                f"{r[f'pf_gemms_g{g}']:.0f}" if g else "",
                                f"{r['attention']:.0f}",
                                f"{r[f'attention_g{g}']:.0f}" if g else "",
                                f"{r['pf_serial']:.0f}", f"{two:.0f}",
                                f"{r['pf_serial'] / two:.2f}x"])
            print(f"{dtype} rows {rows}: {r}", flush=True)
    print(f"\n{args.shape} shape, context {args.context} tokens a row, us a layer:")
    print(markdown_table(["dtype", "rows", "SMs kept from cuBLAS", "projections",
                          "projections, carved", "attention", "one after the other",
                          "two streams, halves", "the longer of the two", "gain"], table))
    if green:
        print("\nThe GPU cut in two: GEMMs on G multiprocessors, attention on the rest:")
        print(markdown_table(["dtype", "rows", "G", "projections", "projections on G",
                              "the same, op by op", "attention", "attention on the rest",
                              "one after the other", "two streams, halves",
                              "the same, op by op", "gain"], green))
    if prefill:
        print(f"\nA prefill's projections of {T} tokens beside every row's decode attention "
              "(G: the GEMMs on G multiprocessors, the attention on the rest):")
        print(markdown_table(["dtype", "rows", "prefill tokens", "G", "prefill projections",
                              "the same on G", "attention", "attention on the rest",
                              "one after the other", "side by side", "gain"], prefill))


if __name__ == "__main__":
    main()
