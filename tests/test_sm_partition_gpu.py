"""`benchmarks/sm_partition.py` on a CUDA device: the two streams' kernels run on disjoint
sets of multiprocessors, as many as the split granted, launched op by op and replayed from
a CUDA graph; and a GEMM and the paged decode read give on them what they give on the
default stream. The oracle for "where": each program of a Triton kernel writes the
hardware's own multiprocessor id (`%smid`).

Skipped cleanly where Triton or a CUDA device is missing."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.sm_partition import split  # noqa: E402

PROGRAMS = 4096  # many more programs than multiprocessors: every one of a set gets some


@triton.jit
def _smid_kernel(out_ptr, sink_ptr, spin):
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)
    acc = smid
    for _ in range(spin):  # long enough that programs pile up on every free multiprocessor
        acc = (acc * 1103515245 + 12345) & 0x7FFFFFFF
    tl.store(out_ptr + tl.program_id(0), smid)
    tl.store(sink_ptr + tl.program_id(0), acc)  # (keeps the loop)


def _sms(out: torch.Tensor) -> set[int]:
    return set(out.cpu().tolist())


def _launch(out: torch.Tensor) -> None:
    _smid_kernel[(PROGRAMS,)](out, torch.empty_like(out), 2000)


def _launch_on(streams, outs) -> None:
    """One launch on each stream into its own output, joined back into the current one."""
    main = torch.cuda.current_stream()
    for stream, out in zip(streams, outs):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            _launch(out)
        main.wait_stream(stream)


def test_two_parts_run_on_disjoint_multiprocessors() -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    first, rest, (n_first, n_rest) = split(total // 2)
    assert n_first >= total // 2 and n_first + n_rest <= total
    outs = [torch.full((PROGRAMS,), -1, dtype=torch.int32, device="cuda") for _ in range(3)]
    _launch_on((first, rest), outs)
    _launch(outs[2])  # the default stream: every multiprocessor
    torch.cuda.synchronize()
    on_first, on_rest, on_all = (_sms(o) for o in outs)
    assert -1 not in on_first | on_rest
    assert len(on_first) == n_first and len(on_rest) == n_rest
    assert not on_first & on_rest
    assert len(on_all) == total


def test_a_captured_graph_keeps_the_partition() -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    first, rest, (n_first, n_rest) = split(total // 2)
    outs = [torch.full((PROGRAMS,), -1, dtype=torch.int32, device="cuda") for _ in range(2)]

    _launch_on((first, rest), outs)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch_on((first, rest), outs)
    for o in outs:
        o.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    on_first, on_rest = _sms(outs[0]), _sms(outs[1])
    assert len(on_first) == n_first and len(on_rest) == n_rest
    assert not on_first & on_rest


def test_kernels_on_a_part_give_the_default_streams_results() -> None:
    from nanoserve_kernels.paged_attention import paged_decode_attention

    torch.manual_seed(0)
    first, rest, _ = split(16)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    B, Hq, Hkv, D, bs, blocks = 37, 8, 2, 64, 16, 12
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B * blocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(B * blocks, device="cuda", dtype=torch.int32).view(B, blocks)
    lens = torch.randint(1, blocks * bs + 1, (B,), device="cuda", dtype=torch.int32)

    def work():
        return (x @ w.t(), paged_decode_attention(q, k, v, tables, lens, D ** -0.5))

    expected = work()
    for stream in (first, rest):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = work()
        torch.cuda.current_stream().wait_stream(stream)
        torch.testing.assert_close(got[0], expected[0])  # (cuBLAS may pick another kernel)
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)


def test_a_split_past_the_gpu_says_so() -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match="first_sms must be in"):
        split(total)
    with pytest.raises(ValueError, match="first_sms must be in"):
        split(0)
