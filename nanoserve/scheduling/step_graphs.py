"""The continuous runner's CUDA graphs (`StepGraphs`, a part of
`nanoserve.scheduling.model_runner.ContinuousRunner`): one per decode bucket, captured at load in one
memory pool; the fixed prefills' (per padded length and kind) as their lengths are met, or
all at once (`capture_prefills`).

Memory: the graphs live outside the KV pool, in what the pool left free. Decode graphs that
do not fit there (or a capture the driver refuses) are dropped at load and the steps run
"static" (the same code over the same fixed tensors, uncaptured) with a warning; a prefill
graph that does not fit leaves its length and kind uncaptured, with a warning, and the run
goes on.

Invariants: a capture runs on a side stream into the runner's one memory pool, and records
launches only (the inputs staged for a run just queued stay as they are); what runs
captured and uncaptured gives the same tokens.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from nanoserve.scheduling.fixed_prefill import prefill_lengths

log = logging.getLogger(__name__)


class StepGraphs:
    """Capturing a `ContinuousRunner`'s graphs (mixed into it: the runner's `__init__` sets
    the fields these read and fill, `_graphs`, `_graph_out`, `_pf_graphs`, `_mask_graphs`,
    `_side`, `_mempool`, ...; the forwards captured are the runner's `_forward` and the
    fixed prefills' `_prefill_forward`)."""

    def _capture_all(self) -> None:
        """One graph per decode bucket, largest first, in one memory pool; each warmed up
        on a side stream first. The padding-only inputs store nothing and read block 0.

        Memory: the graphs live outside the KV pool, in what the pool left free (LLM's
        `kv_cache_fraction`); their size is logged. If they do not fit there (or a capture
        fails), the runner drops them and runs the same step uncaptured ("static": the same
        tokens, launched one by one), with a warning that says how to leave room."""
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # (the capture ends by emptying it: the same base before)
        before = torch.cuda.memory_reserved(self.device)
        self._inputs[0].fill_(self.pad)
        self._inputs[1].zero_()
        self._inputs[2].fill_(-1)
        self._inputs[3].fill_(1)
        try:
            self._capture_buckets()
            failure = None
        except torch.OutOfMemoryError:
            failure = "out of memory"
        except RuntimeError as exc:  # a capture the driver refused
            failure = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if failure is not None:  # here the exception and its frames are gone
            self._drop_graphs(failure)
            return
        self.capture_s = time.perf_counter() - t0
        self.graph_bytes = max(0, torch.cuda.memory_reserved(self.device) - before)
        free, _ = torch.cuda.mem_get_info(self.device)
        log.info("captured %d decode-step graphs (batch %d..%d) in %.1f s: %.0f MiB outside "
                 "the KV pool, %.0f MiB of the device left free (prefills up to %d tokens are "
                 "captured as their lengths are met)", len(self._graphs), min(self.buckets),
                 max(self.buckets), self.capture_s, self.graph_bytes / 2**20, free / 2**20,
                 self.prefill_tokens)

    def _capture_buckets(self) -> None:
        """The decode steps' graphs, largest bucket first, in one memory pool (the fixed
        prefills' graphs join it as their lengths are met: `_prefill_fixed`)."""
        self._mempool = torch.cuda.graph_pool_handle()
        self._prefill_buffers()
        for b in sorted(self.buckets, reverse=True):
            views = self._views(b)
            self._graph_out[b], self._graphs[b] = self._capture(self._forward, *views)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' memory (the graphs keep their pool)

    def _capture(self, fn, *args, warm: bool = True) -> tuple[object, torch.cuda.CUDAGraph]:
        """fn(*args) run once on a side stream (warm: a warm-up), then captured there into
        the runner's memory pool: (its result, the graph). What `torch.cuda.graph` does,
        without its device sync and emptied caches before each capture (the warm-ups' memory
        freed, then allocated again); `_capture_buckets` empties them once."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), warnings.catch_warnings():
            if warm:
                fn(*args)
            # An allocation that fails before the first kernel leaves an empty graph,
            # which torch reports as a capture on the wrong stream; the failure itself
            # is what `_capture_all` reports. A captured forward is never empty.
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            # thread_local: another thread's CUDA calls (none of ours) cannot spoil it
            graph.capture_begin(pool=self._mempool, capture_error_mode="thread_local")
            try:
                out = fn(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        return out, graph

    def _drop_graphs(self, failure: str) -> None:
        """A capture failed: release what it made and run uncaptured from now on."""
        self._graphs.clear()
        self._graph_out.clear()
        self._pf_graphs.clear()
        self._mask_graphs.clear()
        self._mask_out.clear()
        self.prefill_tokens, self._pf_buf, self._pf_hidden = 0, None, None  # eager prefills
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        self.capture_error = failure
        self.mode = "static"
        advice = ("to capture them, leave room with a smaller kv_cache_fraction "
                  "(--kv-cache-fraction) or max_batch_size" if failure == "out of memory"
                  else "the tokens are the same")
        log.warning("the decode-step CUDA graphs were not captured (%s; %.0f MiB of the device "
                    "free after the KV pool): decode steps run uncaptured, which is slower; %s",
                    failure, free / 2**20, advice)

    def capture_summary(self) -> dict:
        """How this runner's steps run: step mode, decode-step graphs and prefill graphs
        captured so far, the decode graphs' memory (MiB) and capture time (s), and why they
        were not captured (None when they were or when none were asked for)."""
        return {"step_mode": self.mode, "graphs": len(self._graphs),
                "prefill_graphs": len(self._pf_graphs),
                "prefill_capture_s": round(self.prefill_capture_s, 2),
                "mask_graphs": len(self._mask_graphs),
                "graph_mib": round(self.graph_bytes / 2**20, 1),
                "capture_s": round(self.capture_s, 2), "capture_error": self.capture_error}

    def capture_prefills(self, max_tokens: int | None = None) -> int:
        """Capture now, before any row runs, the fixed prefills of every length up to
        `max_tokens` (default `prefill_tokens`) and both kinds not captured yet, so that no
        prefill of a run pays its capture. The first of each kind is warmed up by a run
        first (its kernels compiled, cuBLAS set up on the capture stream); the others only
        meet new GEMM shapes, which a capture may. Each runs rows of
        padding alone (each within the model's context): they store nothing, and the paged
        kind's rows read one block of the padding row's table (block 0, in range). Returns
        how many were captured (mode "graph" only)."""
        if self.mode != "graph" or not self.prefill_tokens:
            return 0
        t0 = time.perf_counter()
        bs = self.pool.block_size
        # the most tokens a padding row holds: within the context and its block table
        row = min(self.model.config.max_position_embeddings, self.width * bs) - bs
        done = 0
        warm = {False: True, True: True}  # per kind: its next capture runs a warm-up first
        for T in prefill_lengths(min(max_tokens or self.prefill_tokens, self.prefill_tokens)):
            lens = [min(row, T - i) for i in range(0, T, row)]
            for paged in (False, True):
                if (T, paged) in self._pf_graphs or (T, paged) in self._pf_failed:
                    continue
                if len(lens) >= self._pf_rows:
                    continue
                self._stage_prefill(T, paged, [[0] * n for n in lens], [-1] * T,
                                    [bs if paged else 0] * len(lens), [self.pad] * len(lens),
                                    [], [])
                try:
                    self._pf_graphs[T, paged] = self._capture(self._prefill_forward, T, paged,
                                                              warm=warm[paged])[1]
                    warm[paged] = False
                    done += 1
                except (torch.OutOfMemoryError, RuntimeError) as exc:
                    self._pf_failed.add((T, paged))
                    log.warning("the prefill graph of %d tokens was not captured (%s): such "
                                "prefills run uncaptured; the tokens are the same", T,
                                (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        torch.cuda.synchronize(self.device)
        self.prefill_capture_s += time.perf_counter() - t0
        return done

    def _capture_prefill(self, T: int, paged: bool) -> None:
        """Capture the fixed prefill of T tokens and kind `paged`, just run uncaptured (its
        warm-up: its kernels are compiled, its shapes met), for the next prefills of that
        length and kind. The capture records launches and runs nothing: the inputs staged
        for the run just queued stay as they are. Lengths are captured as they are met, so
        a small job pays for few (all 112 at load took the 1B shape's engine 9.4 s more to
        load on an H200). A capture that fails (the memory the KV pool left is short) leaves
        that length and kind uncaptured, with a warning, and the run goes on."""
        t0 = time.perf_counter()
        try:
            self._pf_graphs[T, paged] = self._capture(self._prefill_forward, T, paged,
                                                      warm=False)[1]
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            self._pf_failed.add((T, paged))
            log.warning("the prefill graph of %d tokens was not captured (%s): such prefills "
                        "run uncaptured, which costs the host more; the tokens are the same",
                        T, (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        self.prefill_capture_s += time.perf_counter() - t0
