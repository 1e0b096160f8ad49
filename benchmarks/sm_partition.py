"""Two CUDA streams on disjoint sets of one GPU's multiprocessors (CUDA green contexts).

Why: two kernels launched on two ordinary streams do not share the GPU by halves. Whichever
starts first takes every multiprocessor it has blocks for, and the other waits; cuBLAS's
GEMMs and the paged decode read both have blocks for all of them at batch scale
(`benchmarks/overlap.py`). A green context owns a fixed set of multiprocessors, and work
on a stream of it runs only there. `split(n)` cuts the device in two such sets, `n` and the
rest, and gives a stream on each: a kernel on one then runs beside a kernel on the other.

Through the CUDA driver (libcuda, found by ctypes; no extra package): the device's SM
resource, split by count, one green context per part, one stream per context. The parts
follow the driver's granularity (a multiple of 8 multiprocessors on Hopper): the counts
returned are the ones granted. The contexts live as long as the process.

    first, rest, (n_first, n_rest) = split(64)   # torch.cuda.ExternalStream each
"""

from __future__ import annotations

import ctypes
import functools

import torch

_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
_DEFAULT_STREAM = 1  # CU_GREEN_CTX_DEFAULT_STREAM: cuGreenCtxCreate's required flag
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: cuGreenCtxStreamCreate's required flag
# A CUdevResource is opaque here: 144 bytes in CUDA 12.4 (the type, 92 bytes of padding,
# then a 48-byte union whose SM member starts with its count); a larger buffer leaves
# room for later ABIs, as only one resource is ever written to each.
_RESOURCE_BYTES = 1024
_SM_COUNT_OFFSET = 96

_contexts: list[ctypes.c_void_p] = []  # kept alive: a stream needs its context


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"green contexts need the CUDA driver (libcuda.so.1): {e}") from None
    for name in ("cuDevSmResourceSplitByCount", "cuGreenCtxCreate", "cuGreenCtxStreamCreate"):
        if not hasattr(lib, name):
            raise RuntimeError(f"this CUDA driver has no {name}: green contexts need 12.4+")
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDeviceGetDevResource.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.cuDevSmResourceSplitByCount.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_uint, ctypes.c_uint]
    lib.cuDevResourceGenerateDesc.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    lib.cuGreenCtxCreate.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.cuGreenCtxStreamCreate.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        what = name.value.decode() if name.value else "unknown error"
        raise RuntimeError(f"{call} failed: {what} ({result})")


def _sm_count(resource: ctypes.Array) -> int:
    return int.from_bytes(bytes(resource[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4]), "little")


def split(first_sms: int, device: torch.device | int | None = None
          ) -> tuple[torch.cuda.ExternalStream, torch.cuda.ExternalStream, tuple[int, int]]:
    """Streams on two disjoint sets of `device`'s multiprocessors: at least `first_sms`
    (rounded up to the driver's granularity) and the rest -> (first stream, rest stream,
    (their multiprocessor counts)). Work on either runs only on its own set; order work
    between them with events (`Stream.wait_stream`), as for any two streams."""
    index = torch.cuda._utils._get_device_index(device, optional=True)
    torch.cuda.init()  # the primary context, which the streams' kernels are loaded in
    lib = _driver()
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    _check(lib.cuDeviceGetDevResource(dev, whole, _SM), "cuDeviceGetDevResource")
    if not 0 < first_sms < _sm_count(whole):
        raise ValueError(f"first_sms must be in 1..{_sm_count(whole) - 1} on this GPU "
                         f"({_sm_count(whole)} multiprocessors), got {first_sms}")
    first = ctypes.create_string_buffer(_RESOURCE_BYTES)
    rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
    groups = ctypes.c_uint(1)
    _check(lib.cuDevSmResourceSplitByCount(first, ctypes.byref(groups), whole, rest, 0,
                                           first_sms), "cuDevSmResourceSplitByCount")
    if groups.value != 1 or _sm_count(rest) == 0:
        raise ValueError(f"{first_sms} multiprocessors leave none for the second set "
                         f"on this GPU ({_sm_count(whole)})")
    streams = []
    for part in (first, rest):
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), part, 1),
               "cuDevResourceGenerateDesc")
        _check(lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, _DEFAULT_STREAM),
               "cuGreenCtxCreate")
        _contexts.append(ctx)
        _check(lib.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, _NON_BLOCKING, 0),
               "cuGreenCtxStreamCreate")
        streams.append(torch.cuda.ExternalStream(stream.value, device=index))
    return streams[0], streams[1], (_sm_count(first), _sm_count(rest))
