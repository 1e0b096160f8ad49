"""The GPU side of continuous batching: packed prefills and bucketed decode steps over
fixed tensors, captured once per engine as CUDA graphs, with results read back late.

Row slots. Each running row holds a row slot r in [0, max_batch_size) for as long as it
runs. `last_tok[r]` (on the device) is its latest token: a prefill writes the sampled
first token there, each decode step reads it as input and writes the next one back. So
step t+1 can be queued before the host has seen step t's tokens: the host only learns
them later, from a pinned copy (`read`), and runs the stop rules while the GPU computes.
Slot `max_batch_size` is the padding row: it stores nothing (write slot -1), reads one
token of block 0 and its token is never read.

Block tables live per row slot too: `block_tables[r]` [W] int32, W = the most blocks a row
can ever hold. The host sends only what changed (a row's new blocks) before a step.

Packed prefills, and the fixed tensors they run from up to `prefill_tokens`:
`nanoserve.scheduling.fixed_prefill`. Capturing the steps' and prefills' CUDA graphs, and running
uncaptured when they do not fit: `nanoserve.scheduling.step_graphs`.

Decode step for n rows, run at the smallest bucket b >= n (buckets 1, 2, 4, 8, then
multiples of 16 up to 256 and of 32 above, up to max_batch_size: `decode_buckets`): inputs are fixed views [b] of one device buffer
(row slots, positions, write slots, context lengths), refilled by one copy from pinned
staging; rows n..b-1 are padding. The step's forward (gather the rows' tokens and block
tables, the model, the LM head, argmax, scatter into last_tok) is one CUDA graph per
bucket ("graph"), or the same code run eagerly over the same tensors ("static"), or run
over freshly made tensors of exactly n rows with no padding ("eager", the plain path the
other two are held to). Rows that sample (temperature > 0) draw after the step, on the
device, and overwrite their argmax in last_tok. A structured output's greedy step takes
every row's masked argmax after it instead, from a fixed bitmask buffer: one more graph
per bucket, captured at its first use (`_masked_step`), its masks filled on the host by
a fill thread while the host prepares the next step (`begin_sampling`). The graphs of
all buckets write their logits into one shared buffer.

LoRA adapters (an engine built with some: `adapters`, nanoserve/scheduling/lora_slots.py):
`lora_slot[r]` (on the device, beside the block tables) is row slot r's adapter slot (-1: the
base model), set when the row is admitted (`set_lora_slots`); a step reads its rows' entries
into a `LoraStep` inside its forward (a decode step per row, a prefill per token through the
rows' starts), so the graphs captured over the fixed tensors serve any mix of adapters.

Staging and result buffers form a ring of RING entries; an operation (a prefill or a
step) takes the next entry, and the host waits for the entry's previous use to have
finished before it rewrites it. At most RING - 1 operations are unread at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from nanoserve.cache.pool import KVPool
from nanoserve.cache.step_cache import StepCache
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import LlamaForCausalLM, PlacedImages
from nanoserve.sampling.logprobs import prompt_logprob_rows
from nanoserve.sampling.params import MAX_LOGPROBS
from nanoserve.sampling.step_sampling import StepSampling, sample_step
from nanoserve.sampling.structured import FillThread
from nanoserve.scheduling.fixed_prefill import (
    PREFILL_GRAPH_TOKENS,
    FixedPrefills,
    prefill_length,
    prefill_lengths,
)
from nanoserve.scheduling.lora_slots import AdapterSlots
from nanoserve.scheduling.step_graphs import StepGraphs
from nanoserve_kernels import backend as kernel_backend

log = logging.getLogger(__name__)

@dataclass
class PrefillImages:
    """A packed prefill's image inputs: positions [3][N] (every packed token's multimodal
    rotary positions; text tokens' three equal), index [M] (the packed offsets of the
    image tokens whose features it computes), embeds [M, d] (those features, on the
    device)."""

    positions: list[list[int]]
    index: list[int]
    embeds: torch.Tensor


RING = 4
STEP_MODES = ("eager", "static", "graph")
# Context length the captured decode kernel's split count is chosen for (a longer context
# is still read whole: the last split takes the rest).
SPLIT_CONTEXT_HINT = 4096


def decode_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, multiples of 16 up to 256, then multiples of 32, then max_batch_size
    itself: the step sizes that get a graph (40 up to 1,024 rows; above 256 a step's GEMMs
    are compute-bound, so a bucket of 32 wastes at most 31 rows' FLOPs of >= 257)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    out += list(range(16, min(max_batch_size, 257), 16))
    out += list(range(288, max_batch_size, 32))
    return out + [max_batch_size]


@dataclass
class Launched:
    """An operation queued on the device whose tokens the host has not read yet. After
    `read`, `logprobs` holds the logprob rows of its sampling's `logprob_rows` and `prompt`
    the prompt-logprob rows of the prefill's rows that asked, both on the host."""

    ring: int  # ring entry holding its results
    n: int  # tokens it produced (rows that sample; all rows of a decode step)
    logprobs: torch.Tensor | None = None  # [m, 2 + 2k] float32, host
    prompt: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, [len-1, ..])
    pending: tuple | None = None  # a deferred decode's (logits, argmax tokens, slots, end, b)
    masks: torch.Tensor | None = None  # its bitmask rows, being filled (`begin_sampling`)


class ContinuousRunner(StepGraphs, FixedPrefills):
    """Owns the fixed device tensors, the ring and (mode "graph") one CUDA graph per bucket.
    Built once per engine (LLM) and reused by every continuous batch run on its pool."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, max_batch_size: int,
                 mode: str = "eager", max_blocks_per_row: int | None = None,
                 pad_prefills: bool | None = None, adapters: AdapterSlots | None = None
                 ) -> None:
        """adapters: the engine's LoRA adapters and their device slots (attached to the
        model here; None: none). pad_prefills: run packed prefills launched op by op (mode "eager", or longer than
        `prefill_tokens`) at `prefill_length` tokens (default: on a CUDA device, where a GEMM
        of a shape cuBLAS has not met costs the host 5-15x one it has; a prefill whose padding
        its table could not hold runs unpadded). Fixed-tensor prefills are always padded."""
        if mode not in STEP_MODES:
            raise ValueError(f"step mode must be one of {STEP_MODES}, got {mode!r}")
        if mode == "graph" and pool.device.type != "cuda":
            raise ValueError("step mode 'graph' needs a CUDA device")
        self.model, self.pool, self.mode = model, pool, mode
        self.max_batch_size = B = max_batch_size
        dev = pool.device
        self.device = dev
        ctx = model.config.max_position_embeddings
        W = max_blocks_per_row or -(-ctx // pool.block_size)
        self.width = max(1, min(W, pool.num_blocks))
        self.pad = B  # the padding row slot
        self.pad_prefills = dev.type == "cuda" if pad_prefills is None else pad_prefills
        self.last_tok = torch.zeros(B + 1, dtype=torch.long, device=dev)  # [B + 1]
        self.block_tables = torch.zeros(B + 1, self.width, dtype=torch.int32, device=dev)
        self.adapters = adapters
        self.lora_slot = torch.full((B + 1,), -1, dtype=torch.int32, device=dev)  # [B + 1]
        if adapters is not None:
            adapters.weights.attach(model)
        self._inputs = torch.zeros(4, B, dtype=torch.long, device=dev)  # slot, pos, write, ctx
        pin = dev.type == "cuda"
        self._stage = torch.zeros(RING, 4, B, dtype=torch.long, pin_memory=pin)
        self._bt_stage = torch.zeros(RING, 3, B, dtype=torch.long, pin_memory=pin)
        # numpy views of the staging buffers: the host writes a step's lists through them
        # (a tenth of what torch.tensor from lists and slice assignments cost per step)
        self._stage_np, self._bt_stage_np = self._stage.numpy(), self._bt_stage.numpy()
        self._out = torch.zeros(RING, B, dtype=torch.long, pin_memory=pin)
        # Logprob rows of an operation's sampled tokens (`nanoserve.sampling.logprobs.logprob_rows`).
        self._lp_out = torch.zeros(RING, B, 2 + 2 * MAX_LOGPROBS, pin_memory=pin)
        # Structured outputs' bitmasks: filled on the host into ring entry k's pinned rows,
        # copied into one fixed device buffer before the step's sampling (made at first use).
        self._bm_host: torch.Tensor | None = None  # [RING, B, words] int32
        self._bm_dev: torch.Tensor | None = None  # [B, words] int32
        # The greedy masked sampling's graphs per bucket (mode "graph": `_masked_step`).
        self._mask_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._mask_out: dict[int, torch.Tensor] = {}  # their tokens [b]
        self._mask_failed: set[int] = set()
        self._fill_thread: FillThread | None = None  # made at first use
        # Fill a greedy masked step's bitmask on that thread, beside the host's Python (else
        # inline, when the sampling is queued: the same tokens).
        self.fill_in_thread = True
        self._done = [torch.cuda.Event() if pin else None for _ in range(RING)]
        self._used = [False] * RING
        self._next = 0
        self.buckets = decode_buckets(B)
        # Fixed-tensor steps ("static", "graph") write their logits into one buffer, so the
        # graphs of all buckets share it instead of each keeping its own [b, V] output.
        self._logits = None if mode == "eager" else torch.empty(
            B, model.config.vocab_size, dtype=model.lm_head.weight.dtype, device=dev)  # [B, V]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits, tokens
        # Fixed-tensor prefills (modes "static" and "graph"): one input buffer laid out per
        # padded length T (`_prefill_views`), the hidden states' shared output, the graphs.
        self.prefill_tokens = 0 if mode == "eager" else max(
            [t for t in prefill_lengths(PREFILL_GRAPH_TOKENS)
             if t <= pool.num_blocks * pool.block_size], default=0)
        self._pf_rows = B + 1  # rows a fixed prefill holds: its admitted rows and the padding
        self._pf_buf = self._pf_hidden = None  # made by _prefill_buffers (graph: in the capture)
        self._pf_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (T, paged)
        self._side: torch.cuda.Stream | None = None  # where graphs are captured
        self._mempool = None  # the graphs' memory pool (mode "graph")
        self._pf_failed: set[tuple[int, bool]] = set()  # prefill graphs that did not fit
        self.prefill_replays = 0  # prefills run as a replayed graph
        self.masked_steps = 0  # decode steps sampled by `_masked_step`
        self.capture_s = 0.0
        self.prefill_capture_s = 0.0  # host seconds spent capturing prefill graphs
        self.graph_bytes = 0
        self.capture_error: str | None = None  # why the graphs were not captured, if so
        # Phase timing (off unless `profile` is set): device time of each prefill and step
        # from event pairs, and host time spent waiting for results.
        self.profile = False
        # The scheduler's host seconds by phase, and "steps" (decode steps), while profile is on.
        self.host_s: dict[str, float] = {}
        self._marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.host_wait_s = 0.0
        if mode == "graph":
            self._capture_all()
        elif mode == "static":
            self._prefill_buffers()


    # --- the step's forward -----------------------------------------------------------------

    def _forward(self, slots: torch.Tensor, positions: torch.Tensor, writes: torch.Tensor,
                 ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for the rows at row slots `slots` [b]: returns logits [b, V] (the
        model's dtype: the argmax of the exact float32 widening is the same, and half the
        bytes move; fixed-tensor modes: a view of the shared buffer) and the argmax tokens
        [b], which are also written to last_tok."""
        ids = self.last_tok.index_select(0, slots)[:, None]  # [b, 1]
        tables = self.block_tables.index_select(0, slots)  # [b, W]
        hint = min(SPLIT_CONTEXT_HINT, self.width * self.pool.block_size)
        cache = StepCache(self.pool, writes, tables, ctx.to(torch.int32), hint)
        lora = self._lora_step(self.lora_slot.index_select(0, slots))  # [b]
        hidden = self.model.hidden_states(ids, positions[:, None], cache,
                                          AttentionMetadata.decode(), lora=lora)
        if self._logits is None:
            logits = self.model.lm_head(hidden[:, 0])  # [b, V]
        else:  # the LM head's own product (no bias), written into the shared buffer
            logits = torch.mm(hidden[:, 0], self.model.lm_head.weight.t(),
                              out=self._logits[:slots.shape[0]])  # [b, V]
        tokens = kernel_backend.argmax_scatter(logits, slots, self.last_tok)  # [b]
        return logits, tokens

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        return tuple(self._inputs[i, :b] for i in range(4))


    # --- the ring ---------------------------------------------------------------------------

    def _take_ring(self) -> int:
        k = self._next
        self._next = (k + 1) % RING
        if self._used[k] and self._done[k] is not None:
            self._done[k].synchronize()  # its last copies have read/written the host buffers
        self._used[k] = True
        return k

    def _finish(self, k: int, tokens: torch.Tensor, n: int,
                end: torch.cuda.Event | None = None, logprobs: torch.Tensor | None = None,
                prompt: list[tuple[int, torch.Tensor]] = (),
                op: Launched | None = None) -> Launched:
        """Queue the copies of an operation's results to the host, then its event."""
        if end is not None:
            end.record()
        self._out[k, :n].copy_(tokens[:n], non_blocking=True)
        op = op or Launched(k, n)
        if logprobs is not None:
            m, cols = logprobs.shape  # a contiguous slice: the copy stays asynchronous
            op.logprobs = self._lp_out[k].view(-1)[:m * cols].view(m, cols)
            op.logprobs.copy_(logprobs, non_blocking=True)
        op.prompt = [(i, self._to_host(t)) for i, t in prompt]
        if self._done[k] is not None:
            self._done[k].record()
        return op

    def mask_rows(self, k: int, m: int, words: int) -> torch.Tensor:
        """Ring entry k's host bitmask rows [>= m, words] int32 (pinned for a CUDA device):
        where an operation's masks are filled. Free again once the entry's operation has
        been read (`_take_ring`)."""
        if self._bm_host is None or self._bm_host.shape[2] != words:
            pin = self.device.type == "cuda"
            B = self.max_batch_size
            self._bm_host = torch.empty(RING, B, words, dtype=torch.int32, pin_memory=pin)
            self._bm_dev = torch.empty(B, words, dtype=torch.int32, device=self.device)
            self._mask_graphs.clear()  # they read the buffer they were captured with
            self._mask_out.clear()
        if m > self._bm_host.shape[1]:  # a prefill's samplers past max_batch_size: not a step
            raise ValueError(f"{m} constrained rows in one operation")
        return self._bm_host[k]

    def _masks(self, k: int, sampling: StepSampling | None) -> None:
        """Fill the constrained rows' bitmask of `sampling` into ring entry k's host rows
        (unless filled already) and copy it into the fixed device buffer. Called after the operation's forward is queued: the host fills
        while the device computes."""
        if sampling is None or not sampling.masked:
            return
        t = time.perf_counter()
        if sampling.bitmask is None:
            sampling.fill(self.mask_rows(k, len(sampling.masked), sampling.words))
        t = self._host_time("mask_fill", t)
        host = sampling.bitmask
        if self.device.type == "cuda" and host.device.type == "cpu":
            dev = self._bm_dev[:host.shape[0]]
            dev.copy_(host, non_blocking=True)
            sampling.bitmask = dev
        self._host_time("mask_copy", t)

    def _host_time(self, key: str, t0: float) -> float:
        t = time.perf_counter()
        if self.profile:
            self.host_s[key] = self.host_s.get(key, 0.0) + t - t0
        return t

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    def read(self, op: Launched) -> list[int]:
        """The operation's tokens (waits for it)."""
        if self._done[op.ring] is not None:
            t = time.perf_counter()
            self._done[op.ring].synchronize()
            self.host_wait_s += time.perf_counter() - t
        return self._out[op.ring, :op.n].tolist()

    def _mark(self, kind: str) -> torch.cuda.Event | None:
        if not (self.profile and self.device.type == "cuda"):
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._marks.append((kind, start, end))
        return end

    def phase_times(self) -> dict[str, float]:
        """Device seconds in prefills and in decode steps and how many of each ran since the
        last call (profile on, CUDA), and host seconds spent waiting for results; resets the
        counters."""
        self.sync()
        out = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_n": 0, "decode_n": 0}
        for kind, start, end in self._marks:
            out[f"{kind}_s"] += start.elapsed_time(end) / 1000
            out[f"{kind}_n"] += 1
        out["host_wait_s"] = self.host_wait_s
        out["host"] = dict(self.host_s)
        self._marks, self.host_wait_s, self.host_s = [], 0.0, {}
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # --- operations -------------------------------------------------------------------------

    def set_block_tables(self, slots: list[int], tables: list[list[int]]) -> None:
        """Rewrite whole block tables of rows (at admission); entries past a table are 0."""
        width = max(len(t) for t in tables)
        if width > self.width:
            raise ValueError(f"a row holds {width} blocks; the step's tables have {self.width}")
        # [rows + 1, width]: the row slots, then the tables (only as wide as the widest)
        host = np.zeros((len(slots) + 1, max(width, len(slots))), dtype=np.int64)
        host[0, :len(slots)] = slots
        for i, t in enumerate(tables, 1):
            host[i, :len(t)] = t
        dev = self._upload(torch.from_numpy(host))
        idx = dev[0, :len(slots)]
        self.block_tables.index_fill_(0, idx, 0)
        self.block_tables[:, :width].index_copy_(0, idx, dev[1:, :width].to(torch.int32))

    def set_lora_slots(self, slots: list[int], lora_slots: list[int]) -> None:
        """Set rows' adapter slots (-1: the base model) at admission."""
        if self.adapters is not None:
            idx, val = self._upload(torch.tensor([slots, lora_slots], dtype=torch.long))
            self.lora_slot.index_copy_(0, idx, val.to(torch.int32))

    def set_last_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """Set rows' latest tokens from the host (a recomputed row's last token)."""
        idx, val = self._upload(torch.tensor([slots, tokens], dtype=torch.long))
        self.last_tok.index_copy_(0, idx, val)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runner's device, through pinned memory on a GPU: the copy
        is queued and the host goes on (a copy from pageable memory may first wait for the
        device to finish the work queued before it)."""
        if self.device.type != "cuda":
            return host
        # (`host.pin_memory()` first asks whether host is pinned: 3.4 ms on an H200's host.)
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
        return pinned.to(self.device, non_blocking=True)

    def prefill(self, tokens: list[list[int]], writes: list[int], slots: list[int],
                sample_from: list[int], sample_slots: list[int],
                sampling: StepSampling | None, cached: list[int] | None = None,
                prompt_logprobs: list[tuple[int, int]] = (),
                images: PrefillImages | None = None) -> Launched:
        """One packed prefill of several rows' new tokens: writes their K/V to `writes` (one
        slot per token, in order). From the fixed tensors (modes "static" and "graph", up to
        `prefill_tokens`), or launched op by op with `pad_prefills`, the packed tokens are
        followed by a row of padding up to `prefill_length` of their count (token 0 at
        positions 0.., write slots -1, the padding row slot's table): a graph per length, or
        GEMMs that meet few shapes; every op a row's results go through is its own tokens'
        (the attention keeps to each row, everything else is per token). Then each sampler
        j draws a token from the logits of the last position of row `sample_from[j]`
        (several samplers may share one row: a prompt's n samples) under `sampling` (one
        entry per sampler) and stores it in last_tok at row slot `sample_slots[j]`.
        cached: per row, how many tokens before `tokens` its block table already holds (the
        prefix cache's blocks): those rows' new tokens sit at positions cached.. and attend
        to the cached context through their block tables (set beforehand; `slots` are the
        rows' row slots).
        prompt_logprobs: (row, k) for rows whose new tokens are their whole prompt and that
        want its logprobs (read back in `Launched.prompt`).
        images: rows with images (Qwen2.5-VL): the packed tokens' multimodal rotary positions
        and the image features placed at their placeholders; such a prefill runs launched op
        by op (its inputs are not token ids alone)."""
        end = self._mark("prefill")
        cached = cached or [0] * len(tokens)
        lens = [len(t) for t in tokens]
        n = sum(lens)
        T = prefill_length(n)
        fixed = (images is None and T <= self.prefill_tokens and len(tokens) < self._pf_rows
                 and len(sample_from) <= self.max_batch_size
                 and not (any(cached) and T - n > self.width * self.pool.block_size))
        if fixed:
            hidden, ids_t, cu, last, idx = self._prefill_fixed(T, tokens, lens, writes, slots,
                                                               cached, sample_from,
                                                               sample_slots)
        else:
            hidden, ids_t, cu, last, idx = self._prefill_eager(tokens, lens, writes, slots,
                                                               cached, sample_from,
                                                               sample_slots, images)
        prompt = []
        for i, k_top in prompt_logprobs:
            targets = ids_t[0, cu[i] + 1:cu[i + 1]]
            prompt.append((i, prompt_logprob_rows(self.model.compute_logits,
                                                   hidden[0, cu[i]:cu[i + 1] - 1], targets, k_top)))
        k = self._take_ring()
        if not sample_from:
            return self._finish(k, self.last_tok, 0, end, prompt=prompt)
        h = hidden[0].index_select(0, last)  # [S, d]
        logits = self.model.compute_logits(h)
        self._masks(k, sampling)
        new, lp = sample_step(logits, sampling)
        self.last_tok.index_copy_(0, idx, _as_input(new, sampling))
        return self._finish(k, new, len(sample_from), end, lp, prompt)

    def _prefill_eager(self, tokens, lens, writes, slots, cached, sample_from, sample_slots,
                       images: PrefillImages | None = None):
        """A packed prefill launched op by op (see `prefill`): (hidden states [1, N', d],
        token ids [1, N'], row starts, the samplers' positions and row slots)."""
        pad = prefill_length(sum(lens)) - sum(lens) if self.pad_prefills else 0
        if pad > self.width * self.pool.block_size:  # its table could not hold it: none
            pad = 0
        if pad:  # one more row, of padding: it stores nothing and no row attends to it
            tokens, lens, cached = tokens + [[0] * pad], lens + [pad], cached + [0]
            slots, pad_writes = slots + [self.pad], [-1] * pad
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        N, R, S = cu[-1], len(tokens), len(sample_from)
        # Every input in one host tensor, one copy: token ids [N], positions [N], K/V
        # slots [N], row starts [R + 1], row slots [R], context lengths [R], the samplers'
        # last positions [S] and row slots [S].
        host = torch.from_numpy(np.fromiter(chain(
            chain.from_iterable(tokens),
            chain.from_iterable(range(c, c + n) for c, n in zip(cached, lens)),
            writes, pad_writes if pad else (), cu, slots, [c + n for c, n in zip(cached, lens)],
            [cu[i + 1] - 1 for i in sample_from], sample_slots), dtype=np.int64))
        if host.numel() != 3 * N + 3 * R + 1 + 2 * S:
            raise ValueError("prefill: one K/V slot per token and one row slot per row")
        inputs = self._upload(host)
        ids_t, pos_t, writes_t, cu_t, rows_t, ctx_t, last, idx = inputs.split(
            [N, N, N, R + 1, R, R, S, S])
        ids_t, pos_t, cu_t = ids_t[None], pos_t[None], cu_t.to(torch.int32)  # [1, N]
        if any(cached):
            cache = StepCache(self.pool, writes_t, self.block_tables.index_select(0, rows_t),
                              ctx_t.to(torch.int32))
        else:
            cache = StepCache(self.pool, writes_t)
        placed = None
        if images is not None:  # [3, 1, N] positions (padding: its own 0.., all three)
            pad_pos = list(range(pad)) if pad else []
            pos_t = torch.tensor([p + pad_pos for p in images.positions],
                                 device=self.device)[:, None]
            placed = PlacedImages(torch.tensor(images.index, dtype=torch.long, device=self.device),
                                  images.embeds)
        hidden = self.model.hidden_states(ids_t, pos_t, cache,
                                          AttentionMetadata.packed(cu_t, max(lens)), placed,
                                          lora=self._token_lora(cu_t, rows_t, N))
        return hidden, ids_t, cu, last, idx


    def decode(self, slots: list[int], positions: list[int], writes: list[int],
               new_blocks: list[tuple[int, int, int]], sampling: StepSampling | None,
               defer: bool = False, before=None, rope_deltas: list[int] | None = None
               ) -> Launched:
        """One decode step for n rows: row slots, the position of each row's input token,
        the slot its K/V go to (reserved by the caller), and the block-table entries that
        changed since the last step as (row slot, index, block). sampling: per row (None:
        all greedy, nothing but the step's argmax). defer: queue the forward only; the
        caller queues the sampling with `finish_decode` (a structured output's masks need
        the rows' previous tokens, read while this forward runs) before any other step.
        before: called once the step's inputs are staged on the host and its block-table
        entries queued, before the rest of the step is (what must come first: the previous
        step's deferred sampling, whose masks may still be filling).
        rope_deltas: per row, what its rotary position is ahead of its cache position (a
        row with images: nanoserve/multimodal/mrope.py; <= 0); None: all 0. `positions` stay cache
        positions (the context length is position + 1)."""
        n = len(slots)
        k = self._take_ring()
        if new_blocks:
            self._update_tables(k, new_blocks)
        if self.mode != "eager":
            b = next(x for x in self.buckets if x >= n)
            stage = self._stage_np[k]  # [4, B]: slots, positions, writes, context lengths
            stage[0, :n], stage[1, :n], stage[2, :n] = slots, positions, writes
            np.add(stage[1, :n], 1, out=stage[3, :n])
            if rope_deltas is not None:
                stage[1, :n] += rope_deltas
            stage[0, n:b], stage[1, n:b], stage[2, n:b], stage[3, n:b] = self.pad, 0, -1, 1
        if before is not None:
            before()
        end = self._mark("decode")
        if self.mode == "eager":
            ctx = [p + 1 for p in positions]
            if rope_deltas is not None:
                positions = [p + d for p, d in zip(positions, rope_deltas)]
            inputs = torch.tensor([slots, positions, writes, ctx], dtype=torch.long)
            inputs = inputs.to(self.device, non_blocking=True)
            logits, tokens = self._forward(*inputs)
            where, b = inputs[0], n
        else:
            self._inputs[:, :b].copy_(self._stage[k, :, :b], non_blocking=True)
            if self.mode == "graph":
                self._graphs[b].replay()
                logits, tokens = self._graph_out[b]
            else:
                logits, tokens = self._forward(*self._views(b))
            where = self._inputs[0, :n]
        op = Launched(k, n, pending=(logits, tokens, where, end, b))
        if not defer:
            self.finish_decode(op, sampling)
        return op

    def begin_sampling(self, op: Launched, sampling: StepSampling | None) -> None:
        """Start the part of a deferred decode step's sampling that can run beside the host's
        Python: for a greedy masked step of the fixed tensors (`_masked_step`), filling its
        bitmask rows on the fill thread (xgrammar lets go of the GIL). `finish_decode`
        completes it, and must come before any other operation is queued; in between the
        caller must not advance a matcher of the step's rows."""
        if (self.mode == "eager" or sampling is None or not sampling.greedy_masked
                or not self.fill_in_thread):
            return
        if self._fill_thread is None:
            self._fill_thread = FillThread()
        t = time.perf_counter()
        op.masks = sampling.fill_rows(self.mask_rows(op.ring, op.pending[4], sampling.words),
                                      self._fill_thread)
        self._host_time("mask_start", t)

    def drop_sampling(self, op: Launched) -> None:
        """Give up a begun sampling (the run is being aborted): wait for its fill, if any,
        to let go of the buffers; its error, if any, is dropped."""
        if op.masks is not None and self._fill_thread is not None:
            try:
                self._fill_thread.wait()
            except Exception:  # noqa: BLE001 - the run is aborting for another reason
                pass
        op.masks = op.pending = None

    def finish_decode(self, op: Launched, sampling: StepSampling | None) -> None:
        """Queue a decode step's sampling (when not all greedy and plain) and the copies of
        its results. The step's logits must still be in place: no step queued since."""
        logits, tokens, where, end, b = op.pending
        op.pending = None
        lp = None
        if sampling is not None and not sampling.trivial:
            if self.mode != "eager" and sampling.greedy_masked:
                tokens = self._masked_step(op.ring, b, sampling, op.masks)
                op.masks = None
            else:
                self._masks(op.ring, sampling)
                tokens, lp = sample_step(logits[:op.n], sampling, tokens[:op.n])
                self.last_tok.index_copy_(0, where, _as_input(tokens, sampling))
        self._finish(op.ring, tokens, op.n, end, lp, op=op)

    def _masked_step(self, k: int, b: int, sampling: StepSampling,
                     filling: torch.Tensor | None = None) -> torch.Tensor:
        """A fixed-tensor decode step's sampling when every row takes its argmax among its
        allowed tokens (`StepSampling.greedy_masked`): one bitmask row per step row, filled
        on the host into ring entry k's rows (`StepSampling.fill_rows`) and copied into the
        fixed device rows, then `_masked_forward` over bucket b: in mode "graph" one CUDA
        graph per bucket, captured the first time the bucket needs it (a host copy and a
        replay instead of the sampling's launches). filling: the rows `begin_sampling` is
        filling on the fill thread (waited for here). Returns the tokens [b] on the device
        (-1: a row whose grammar allows nothing; rows past the step's are padding)."""
        self.masked_steps += 1
        t = time.perf_counter()
        if filling is None:
            host = sampling.fill_rows(self.mask_rows(k, b, sampling.words))
        else:
            self._fill_thread.wait()
            host = filling
        t = self._host_time("mask_fill", t)
        self._bm_dev[:host.shape[0]].copy_(host, non_blocking=True)
        self._host_time("mask_copy", t)
        graph = self._mask_graphs.get(b)
        if graph is not None:
            graph.replay()
            return self._mask_out[b]
        tokens = self._masked_forward(b)
        if self.mode == "graph" and b not in self._mask_failed:
            try:  # the run above was its warm-up; the capture runs nothing
                self._mask_out[b], self._mask_graphs[b] = self._capture(
                    self._masked_forward, b, warm=False)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                self._mask_failed.add(b)
                log.warning("the masked sampling of %d rows was not captured (%s): it runs "
                            "uncaptured; the tokens are the same", b,
                            (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        return tokens

    def _masked_forward(self, b: int) -> torch.Tensor:
        """Bucket b's greedy masked sampling over the fixed tensors (what its graph holds):
        each row's argmax among the tokens its row of the fixed bitmask allows, from the
        shared logits; written to last_tok at the step's row slots (-1 as 0, a valid input:
        that row ends when read). Returns the tokens [b]."""
        tokens = kernel_backend.masked_argmax(self._logits[:b], self._bm_dev[:b])  # [b]
        self.last_tok.index_copy_(0, self._inputs[0, :b], tokens.clamp_min(0))
        return tokens

    def _update_tables(self, k: int, new_blocks: list[tuple[int, int, int]]) -> None:
        u = len(new_blocks)
        if u > self._bt_stage.shape[2]:  # more rows than max_batch_size gained blocks: not a step
            raise ValueError(f"{u} block-table updates in one step")
        self._bt_stage_np[k][:, :u] = np.array(new_blocks, dtype=np.int64).T
        upd = self._bt_stage[k, :, :u].to(self.device, non_blocking=True)
        self.block_tables[upd[0], upd[1]] = upd[2].to(torch.int32)


def _as_input(tokens: torch.Tensor, sampling: StepSampling | None) -> torch.Tensor:
    """A step's sampled tokens as the next step's inputs: a masked row's -1 (its grammar
    allowed nothing; the row ends when read) becomes 0, a valid id the model may read."""
    return tokens.clamp_min(0) if sampling is not None and sampling.masked else tokens


__all__ = ["RING", "STEP_MODES", "ContinuousRunner", "Launched", "decode_buckets"]
