"""Which implementation runs an op: Triton kernels for CUDA tensors, and for CPU tensors too when
``TRITON_INTERPRET=1`` (how CI tests the kernels); otherwise the vectorised torch version.

The interpreter cannot do bf16 arithmetic (Triton 3.6-3.9 return garbage), so bf16 CPU tensors
always take the torch version rather than give wrong results."""
from __future__ import annotations

import os
from functools import lru_cache

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (INTERPRET and t.dtype != torch.bfloat16)


@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small fixed count on CPU (interpreter). Cached:
    the property query took ~18 us a call on an H100 host, a tenth of a new decode plan."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def q_tma(q: torch.Tensor) -> bool:
    """Whether the queries ``[T, Hq, D]`` can be read by TMA (the Hopper kernels' query boxes): 16-byte aligned
    address and row strides."""
    esize = q.element_size()
    return q.data_ptr() % 16 == 0 and (q.stride(0) * esize) % 16 == 0 and (q.stride(1) * esize) % 16 == 0 \
        and q.stride(2) == 1


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel's successor starts before it ends): Hopper (sm_90)
    and later, never in the interpreter; ``PAGED_BACKEND_PDL=0`` turns it off."""
    return (device.type == "cuda" and not INTERPRET and os.environ.get("PAGED_BACKEND_PDL", "1") != "0"
            and _capability(device)[0] >= 9)


# Triton releases the Gluon kernels were checked on (on the GPU, against the fp64 reference). Gluon
# is experimental and its API moves between releases (3.9 renamed the TMA load), so other releases
# keep the portable kernels.
SM90_TRITON = ("3.6",)


def use_sm90(device: torch.device) -> bool:
    """Whether the Hopper-only (Gluon: TMA, wgmma, warp-specialised) kernels may run: an sm_90 GPU,
    a Triton release in ``SM90_TRITON``, never the interpreter; ``PAGED_BACKEND_SM90=0`` keeps the
    portable kernels everywhere."""
    return (device.type == "cuda" and not INTERPRET and os.environ.get("PAGED_BACKEND_SM90", "1") != "0"
            and triton_release() in SM90_TRITON and _capability(device) == (9, 0))


# The Hopper decode kernel's largest group (its accumulators spill past it: kernels/decode_sm90.py)
SM90_DECODE_GROUP = 16


def sm90_shape(head_dim: int, block_size: int, group: int) -> bool:
    """The head size, page size and query heads per KV head the Hopper kernels take
    (kernels/ring_sm90.py ``covered``): head size 64 or 128, pages of 16+ tokens, a power-of-two
    group of at most 64 (one warpgroup's rows); what a plan knows of them (cascade.fused.hopper_nodes)."""
    return head_dim in (64, 128) and block_size >= 16 and group <= 64 and not group & (group - 1)


@lru_cache(maxsize=None)
def triton_release() -> str:
    """``major.minor`` of the installed Triton."""
    import triton
    return ".".join(triton.__version__.split(".")[:2])
