"""Gumbel-max draws over a vocabulary, fused: for each row ``s`` of scaled (and filtered) logits
``x [S, V]`` fp32, ``argmax_v x[s, v] - log(-log(u[s, v]))`` with ``u`` uniform in (0, 1) from a
counter-based hash of the row's key and the token id::

    h = mix32(key[s] ^ vocab_hash[v]);  u = ((h >> 9) + 0.5) / 2^23

``u`` is exact in fp32 and strictly inside (0, 1) (23 random bits: 24 would round the last
bucket to 1, an infinite noise). ``mix32`` is murmur3's 32-bit finaliser (``paged_backend/gumbel.py``: the op, its torch version and
the hashes). One pass over ``x`` instead of a dozen [S, V] int64 and fp32 tensors (64 rows x 128K
tokens on an H100: ~1 ms of elementwise kernels a step). Ties resolve to the lowest token id, as
``torch.argmax``.

``gumbel_sample_triton`` is the engine's whole draw for rows with a temperature and no filters in
the same pass: the raw logits (any float dtype) divided by the row's temperature (IEEE division,
as torch's), and the raw logits' log-sum-exp for the drawn token's log-probability. A step of 64
rows x 128K tokens read the logits four times before (fp32 copy, log-sum-exp, / T, draw: ~0.17 ms
of an 8B-shaped step on the H200) and launched ~10 kernels from the host.

Programs: (``BLOCK_S`` rows, block of ``BLOCK_V`` tokens), 4096 logits each (one row of a large
vocabulary, many rows of a small one), each row's best (value, token) in its block (and with
``STATS`` the block's raw max, sum of exp below it and the best token's raw logit); then one program of
rows picks each row's best block (the first of equal values: the lowest token id) and folds the stats.
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
def _gumbel_blocks_kernel(x_ptr, temp_ptr, key_ptr, vhash_ptr, best_ptr, arg_ptr, pick_ptr, max_ptr, sum_ptr,
                          S, V, stride_xs, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, SCALE: tl.constexpr,
                          STATS: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    blk = tl.program_id(1)
    v = blk * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    row_ok = rows < S
    ok = row_ok[:, None] & (v < V)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xs + v[None, :], mask=ok,
                other=float("-inf")).to(tl.float32)  # [BLOCK_S, BLOCK_V] (exact from 16-bit)
    y = x
    if SCALE:  # IEEE division, as torch's x / T: the same bits to draw from
        y = tl.math.div_rn(x, tl.load(temp_ptr + rows, mask=row_ok, other=1.0)[:, None])
    key = tl.load(key_ptr + rows, mask=row_ok, other=0).to(tl.uint32)
    h = _mix32(key[:, None] ^ tl.load(vhash_ptr + v, mask=v < V, other=0).to(tl.uint32)[None, :])
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23: exact, as the torch path
    if LIBDEVICE:  # libdevice's logf is torch's CUDA log: the same bits as the torch version
        g = y - libdevice.log(-libdevice.log(u))
    else:  # (the interpreter has no libdevice)
        g = y - tl.log(-tl.log(u))
    g = tl.where(ok, g, float("-inf"))
    best = tl.max(g, 1)  # [BLOCK_S]
    arg = tl.min(tl.where(g == best[:, None], v[None, :], V), 1)  # the first of equal values
    nb = tl.num_programs(1)
    at = rows * nb + blk
    tl.store(best_ptr + at, best, mask=row_ok)
    tl.store(arg_ptr + at, arg, mask=row_ok)
    if STATS:  # the raw logits' max and sum of exp below it; the best token's raw logit
        m = tl.max(x, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a block of -inf only: sum 0, no NaN
        tl.store(max_ptr + at, m, mask=row_ok)
        tl.store(sum_ptr + at, tl.sum(tl.exp(x - m_safe[:, None]), 1), mask=row_ok)
        tl.store(pick_ptr + at, tl.sum(tl.where(v[None, :] == arg[:, None], x, 0.0), 1), mask=row_ok)


@triton.jit
def _gumbel_pick_kernel(best_ptr, arg_ptr, pick_ptr, max_ptr, sum_ptr, token_ptr, logprob_ptr, S, NB,
                        BLOCK_R: tl.constexpr, BLOCK_NB: tl.constexpr, STATS: tl.constexpr):
    # Program: BLOCK_R rows, each row's best block (the first of equal values), its token and (STATS)
    # the token's raw log-probability, pick - logsumexp over the blocks' (max, sum).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    b = tl.arange(0, BLOCK_NB)
    r_ok = r < S
    ok = r_ok[:, None] & (b < NB)[None, :]
    at = r.to(tl.int64)[:, None] * NB + b[None, :]  # [BLOCK_R, BLOCK_NB]
    best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
    top = tl.max(best, 1)
    first = tl.min(tl.where(best == top[:, None], b[None, :], BLOCK_NB), 1)
    first = tl.where(first == BLOCK_NB, 0, first)  # (a row of NaN values only: block 0's token)
    one = r.to(tl.int64) * NB + first  # [BLOCK_R]
    tl.store(token_ptr + r, tl.load(arg_ptr + one, mask=r_ok, other=0).to(tl.int64), mask=r_ok)
    if STATS:
        m = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
        big = tl.max(m, 1)
        big_safe = tl.where(big == float("-inf"), 0.0, big)
        total = tl.sum(tl.load(sum_ptr + at, mask=ok, other=0.0) * tl.exp(m - big_safe[:, None]), 1)
        lse = big_safe + tl.log(tl.where(r_ok, total, 1.0))  # (-inf when every logit is)
        tl.store(logprob_ptr + r, tl.load(pick_ptr + one, mask=r_ok, other=0.0) - lse, mask=r_ok)


def _draw(x, temperature, keys, vocab_hash, stats: bool):
    """Both kernels on x [S, V] (unit stride along V) -> (tokens [S] int64, logprobs [S] fp32 or None)."""
    s, v = x.shape
    block_v = min(BLOCK, triton.next_power_of_2(v))
    block_s = min(BLOCK // block_v, triton.next_power_of_2(s))  # small vocabularies: rows share a program
    nb = triton.cdiv(v, block_v)
    f32 = dict(dtype=torch.float32, device=x.device)
    best, arg = torch.empty((s, nb), **f32), torch.empty((s, nb), dtype=torch.int32, device=x.device)
    pick, mx, sm = (torch.empty((s, nb), **f32) for _ in range(3)) if stats else (best, best, best)
    _gumbel_blocks_kernel[(triton.cdiv(s, block_s), nb)](
        x, keys if temperature is None else temperature, keys, vocab_hash, best, arg, pick, mx, sm, s, v,
        x.stride(0), BLOCK_S=block_s, BLOCK_V=block_v, SCALE=temperature is not None, STATS=stats,
        LIBDEVICE=not INTERPRET, num_warps=8)
    tokens = torch.empty(s, dtype=torch.int64, device=x.device)
    logprobs = torch.empty(s, **f32) if stats else None
    block_nb = triton.next_power_of_2(nb)
    block_r = min(max(1, BLOCK // 4 // block_nb), triton.next_power_of_2(s))  # (~1K values a program)
    _gumbel_pick_kernel[(triton.cdiv(s, block_r),)](best, arg, pick, mx, sm, tokens,
                                                   tokens if logprobs is None else logprobs, s, nb,
                                                   BLOCK_R=block_r, BLOCK_NB=block_nb, STATS=stats, num_warps=4)
    return tokens, logprobs


def gumbel_argmax_triton(x: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """The draw of ``paged_backend.gumbel.gumbel_argmax`` (inputs checked there): x [S, V] fp32 with
    unit stride along V, keys [S] and vocab_hash [V] int64 -> tokens [S] int64."""
    return _draw(x, None, keys, vocab_hash, stats=False)[0]


def gumbel_sample_triton(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                         vocab_hash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw of ``paged_backend.gumbel.gumbel_sample`` (inputs checked there): logits [S, V] any
    float dtype with unit stride along V, temperature [S] fp32 -> (tokens [S] int64, logprobs [S])."""
    return _draw(logits, temperature, keys, vocab_hash, stats=True)
