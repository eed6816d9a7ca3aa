"""Gumbel-max draws over a vocabulary, fused: for each row ``s`` of scaled (and filtered) logits
``x [S, V]`` fp32, ``argmax_v x[s, v] - log(-log(u[s, v]))`` with ``u`` uniform in (0, 1) from a
counter-based hash of the row's key and the token id::

    h = mix32(key[s] ^ vocab_hash[v]);  u = ((h >> 8) + 0.5) / 2^24

``mix32`` is murmur3's 32-bit finaliser (``paged_backend/sample.py``: the op, its torch version and
the hashes). One pass over ``x`` instead of a dozen [S, V] int64 and fp32 tensors (64 rows x 128K
tokens on an H100: ~1 ms of elementwise kernels a step). Ties resolve to the lowest token id, as
``torch.argmax``.

Programs: (row, block of ``BLOCK_V`` tokens), each its block's best (value, token); the launcher
picks the best block per row (the first of equal values: the lowest token id).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from paged_backend.kernels.dispatch import INTERPRET

BLOCK_V = 4096


@triton.jit
def _mix32(x):
    """murmur3's 32-bit finaliser on uint32 (products wrap)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(x_ptr, key_ptr, vhash_ptr, best_ptr, arg_ptr, V, stride_xs, BLOCK_V: tl.constexpr,
                          LIBDEVICE: tl.constexpr):
    s = tl.program_id(0)
    blk = tl.program_id(1)
    v = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = v < V
    x = tl.load(x_ptr + s.to(tl.int64) * stride_xs + v, mask=ok, other=float("-inf"))  # [BLOCK_V] fp32
    key = tl.load(key_ptr + s).to(tl.uint32)
    h = _mix32(key ^ tl.load(vhash_ptr + v, mask=ok, other=0).to(tl.uint32))
    u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24: exact, as the torch path
    if LIBDEVICE:  # libdevice's logf is torch's CUDA log: the same bits as the torch version
        g = x - libdevice.log(-libdevice.log(u))
    else:  # (the interpreter has no libdevice)
        g = x - tl.log(-tl.log(u))
    g = tl.where(ok, g, float("-inf"))
    best = tl.max(g, 0)
    arg = tl.min(tl.where(g == best, v, V), 0)  # the first of equal values
    tl.store(best_ptr + s * tl.num_programs(1) + blk, best)
    tl.store(arg_ptr + s * tl.num_programs(1) + blk, arg)


def gumbel_argmax_triton(x: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """The draw of ``paged_backend.sample.gumbel_argmax`` (inputs checked there): x [S, V] fp32 with
    unit stride along V, keys [S] and vocab_hash [V] int64 -> tokens [S] int64."""
    s, v = x.shape
    nb = triton.cdiv(v, BLOCK_V)
    best = torch.empty((s, nb), dtype=torch.float32, device=x.device)
    arg = torch.empty((s, nb), dtype=torch.int32, device=x.device)
    _gumbel_argmax_kernel[(s, nb)](x, keys, vocab_hash, best, arg, v, x.stride(0), BLOCK_V=BLOCK_V,
                                   LIBDEVICE=not INTERPRET, num_warps=8)
    return arg.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].to(torch.int64)
