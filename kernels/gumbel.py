"""Gumbel-max draws over a vocabulary, fused: for each row ``s`` of scaled (and filtered) logits
``x [S, V]`` fp32, ``argmax_v x[s, v] - log(-log(u[s, v]))`` with ``u`` uniform in (0, 1) from a
counter-based hash of the row's key and the token id::

    h = mix32(key[s] ^ vocab_hash[v]);  u = ((h >> 9) + 0.5) / 2^23

``u`` is exact in fp32 and strictly inside (0, 1) (23 random bits: 24 would round the last
bucket to 1, an infinite noise). ``mix32`` is murmur3's 32-bit finaliser (``paged_backend/gumbel.py``: the op, its torch version and
the hashes). One pass over ``x`` instead of a dozen [S, V] int64 and fp32 tensors (64 rows x 128K
tokens on an H100: ~1 ms of elementwise kernels a step). Ties resolve to the lowest token id, as
``torch.argmax``.

Programs: (``BLOCK_S`` rows, block of ``BLOCK_V`` tokens), 4096 logits each (one row of a large
vocabulary, many rows of a small one), each row's best (value, token) in its block; the launcher
picks the best block per row (the first of equal values: the lowest token id).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from paged_backend.kernels.dispatch import INTERPRET

BLOCK = 4096  # logits a program reads: BLOCK_S rows x BLOCK_V tokens


@triton.jit
def _mix32(x):
    """murmur3's 32-bit finaliser on uint32 (products wrap)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(x_ptr, key_ptr, vhash_ptr, best_ptr, arg_ptr, S, V, stride_xs,
                          BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    blk = tl.program_id(1)
    v = blk * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    row_ok = rows < S
    ok = row_ok[:, None] & (v < V)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xs + v[None, :], mask=ok,
                other=float("-inf"))  # [BLOCK_S, BLOCK_V] fp32
    key = tl.load(key_ptr + rows, mask=row_ok, other=0).to(tl.uint32)
    h = _mix32(key[:, None] ^ tl.load(vhash_ptr + v, mask=v < V, other=0).to(tl.uint32)[None, :])
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23: exact, as the torch path
    if LIBDEVICE:  # libdevice's logf is torch's CUDA log: the same bits as the torch version
        g = x - libdevice.log(-libdevice.log(u))
    else:  # (the interpreter has no libdevice)
        g = x - tl.log(-tl.log(u))
    g = tl.where(ok, g, float("-inf"))
    best = tl.max(g, 1)  # [BLOCK_S]
    arg = tl.min(tl.where(g == best[:, None], v[None, :], V), 1)  # the first of equal values
    nb = tl.num_programs(1)
    tl.store(best_ptr + rows * nb + blk, best, mask=row_ok)
    tl.store(arg_ptr + rows * nb + blk, arg, mask=row_ok)


def gumbel_argmax_triton(x: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """The draw of ``paged_backend.gumbel.gumbel_argmax`` (inputs checked there): x [S, V] fp32 with
    unit stride along V, keys [S] and vocab_hash [V] int64 -> tokens [S] int64."""
    s, v = x.shape
    block_v = min(BLOCK, triton.next_power_of_2(v))
    block_s = min(BLOCK // block_v, triton.next_power_of_2(s))  # small vocabularies: rows share a program
    nb = triton.cdiv(v, block_v)
    best = torch.empty((s, nb), dtype=torch.float32, device=x.device)
    arg = torch.empty((s, nb), dtype=torch.int32, device=x.device)
    _gumbel_argmax_kernel[(triton.cdiv(s, block_s), nb)](x, keys, vocab_hash, best, arg, s, v, x.stride(0),
                                                          BLOCK_S=block_s, BLOCK_V=block_v,
                                                          LIBDEVICE=not INTERPRET, num_warps=8)
    return arg.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].to(torch.int64)
