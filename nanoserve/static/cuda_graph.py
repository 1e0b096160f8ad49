"""A static batch's decode step over fixed tensors, replayed as one CUDA graph.

Why: one decode step of a 16-layer model is a few hundred kernel launches. Launched one
by one from Python they cost the host more time than the GPU needs to run them, so the
GPU idles between kernels. Captured once as a CUDA graph, the whole step (forward and LM
head) is one launch.

Why one capture serves every step of a static batch:
- the batch size never changes (a finished row keeps its place until the batch ends);
- the block tables are as wide as the batch needs at its peak (`max_blocks`), so their
  shape, and the decode kernel's split count chosen from that width, never change;
- every input the step reads lives in a fixed tensor refilled in place before each
  replay: the token ids and positions (here), the write slots, block tables and context
  lengths (the cache's static step tensors, `BatchedPagedKVCache.use_static_step_tensors`).
The output, logits [B, V] float32, is a fixed tensor too: it is overwritten by the next
step, so read it first.

Modes (`DecodeStep(..., capture=...)`): `capture=True` records the graph (CUDA only);
`capture=False` runs the same forward eagerly over the same fixed tensors, which is how
the CPU tests hold this file's bookkeeping to the plain decode path.

Feedback (`feedback=True`, when every row of the batch is greedy): the step also takes the
argmax in place and writes it, with the positions plus one, into its own inputs, so step
t+1 can be queued before step t's tokens reach the host. The host then reads step t's
tokens (copied into one of two pinned buffers) and runs the rows' stop rules while the
GPU computes step t+1: the host's per-step bookkeeping overlaps the GPU instead of adding
to it. Rows that finished keep being fed their own argmax; their tokens are dropped, as
a finished row's are on every path, and no row reads another row's cache.
"""

from __future__ import annotations

import logging
import os

import torch

from nanoserve.cache.pool import BatchedPagedKVCache
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import LlamaForCausalLM
from nanoserve_kernels import backend as kernel_backend

log = logging.getLogger(__name__)

MIN_DECODE_STEPS = 8  # fewer steps than this do not repay a capture
_OFF = ("0", "false", "no", "off")


def graphs_wanted(device: torch.device, decode_steps: int) -> bool:
    """The "auto" rule: capture on CUDA when the Triton kernels serve the step (the
    reference kernels synchronize with the host, which a capture cannot hold), the batch
    runs at least MIN_DECODE_STEPS steps, and NANOSERVE_CUDA_GRAPH is not 0/false/off."""
    if os.environ.get("NANOSERVE_CUDA_GRAPH", "1").strip().lower() in _OFF:
        return False
    return (device.type == "cuda" and kernel_backend.use_triton(device)
            and decode_steps >= MIN_DECODE_STEPS)


class DecodeStep:
    """The decode step of one static batch, built after the prefill.

    Without feedback: call once per step with each row's last token; returns logits
    [B, V] float32 (valid until the next call). With feedback (all rows greedy): `start`
    with each row's last token once, then `launch` queues a step and `read_tokens` returns
    the oldest queued step's argmax tokens, at most two steps queued and unread."""

    def __init__(self, model: LlamaForCausalLM, cache: BatchedPagedKVCache, max_blocks: int,
                 capture: bool, feedback: bool = False) -> None:
        B, device = cache.batch_size, model.device
        self.model, self.cache, self.feedback = model, cache, feedback
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)  # [B, 1]
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)  # [B, 1]
        self.next_ids = torch.zeros(B, dtype=torch.long, device=device)  # [B], feedback only
        pin = device.type == "cuda"
        self._stage = torch.zeros(2, B, 1, dtype=torch.long, pin_memory=pin)  # ids, positions
        self._copied = torch.cuda.Event() if pin else None
        # Feedback: each queued step's tokens land in one of two pinned buffers, in order.
        self._out = [torch.zeros(B, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._out_ready = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._queued = 0  # steps launched
        self._read = 0  # steps whose tokens were read
        cache.use_static_step_tensors(max_blocks)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if capture:
            self._capture()

    def _forward(self) -> torch.Tensor:
        hidden = self.model.hidden_states(self.ids, self.positions, self.cache,
                                          AttentionMetadata.decode())
        logits = self.model.compute_logits(hidden[:, 0])  # [B, V]
        if self.feedback:  # this step's greedy tokens become the next step's inputs
            torch.argmax(logits, dim=-1, out=self.next_ids)
            self.ids.copy_(self.next_ids[:, None])
            self.positions.add_(1)
        return logits

    def _capture(self) -> None:
        """Warm up on a side stream (kernels compiled, library handles made), then record.
        The idle step stores nothing, so neither touches any row's cache."""
        self.cache.fill_idle_step()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward()
        self.graph = graph

    def _set_inputs(self, last_tokens: list[int]) -> None:
        positions = self.cache.seq_lens  # each row's next token sits at its current length
        if self._copied is not None:
            self._copied.synchronize()  # the last copies have read the staging
        self._stage[0, :, 0] = torch.tensor(last_tokens, dtype=torch.long)
        self._stage[1, :, 0] = torch.tensor(positions, dtype=torch.long)
        self.ids.copy_(self._stage[0], non_blocking=True)
        self.positions.copy_(self._stage[1], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _run(self) -> torch.Tensor:
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits

    def __call__(self, last_tokens: list[int]) -> torch.Tensor:
        """One step: reserve each row's next slot, refill the inputs, run. last_tokens: [B]."""
        if self.feedback:
            raise RuntimeError("a feedback step is driven by start/launch/read_tokens")
        self._set_inputs(last_tokens)
        self.cache.begin_decode_step()
        return self._run()

    # --- feedback: queue step t+1 before reading step t's tokens ---------------------------

    def start(self, last_tokens: list[int]) -> None:
        """Set the first step's inputs (each row's last token and its position)."""
        self._set_inputs(last_tokens)

    def launch(self) -> None:
        """Queue one step without waiting for it: reserve each row's next slot, refill the
        fixed tensors (copies queued after the previous step), run, and queue the copy of
        its tokens to the host. At most two steps are queued and unread."""
        if self._queued - self._read >= 2:
            raise RuntimeError("read a step's tokens before queueing a third step")
        self.cache.begin_decode_step()
        self._run()
        k = self._queued % 2
        self._out[k].copy_(self.next_ids, non_blocking=True)
        if self._out_ready[k] is not None:
            self._out_ready[k].record()
        self._queued += 1

    @property
    def unread(self) -> int:
        """Steps queued whose tokens were not read yet."""
        return self._queued - self._read

    def read_tokens(self) -> list[int]:
        """The oldest unread step's tokens, [B], waiting for that step to finish."""
        if self._read >= self._queued:
            raise RuntimeError("no queued step to read")
        k = self._read % 2
        if self._out_ready[k] is not None:
            self._out_ready[k].synchronize()
        self._read += 1
        return self._out[k].tolist()

    def close(self) -> None:
        """Wait for queued work, so the graph and cache can be released safely."""
        if self.model.device.type == "cuda":
            torch.cuda.current_stream().synchronize()


def make_decode_step(model: LlamaForCausalLM, cache: BatchedPagedKVCache, max_blocks: int,
                     mode: str, feedback: bool = False) -> DecodeStep | None:
    """The step for `generate_batch`'s decode_step mode: None for "eager" (the plain path),
    a DecodeStep over fixed tensors for "static", a captured one for "graph". A capture
    that fails for any reason but memory falls back to "static" with a warning: the same
    tokens, launched one by one."""
    if mode == "eager":
        return None
    if mode == "static":
        return DecodeStep(model, cache, max_blocks, capture=False, feedback=feedback)
    if mode != "graph":
        raise ValueError(f"decode_step must be auto, eager, static or graph, got {mode!r}")
    if model.device.type != "cuda":
        raise ValueError("decode_step='graph' needs a CUDA device")
    try:
        return DecodeStep(model, cache, max_blocks, capture=True, feedback=feedback)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        log.warning("CUDA graph capture of the decode step failed (%s); running it uncaptured", exc)
        torch.cuda.synchronize()
        return DecodeStep(model, cache, max_blocks, capture=False, feedback=feedback)
