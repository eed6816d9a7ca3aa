"""Top-p without sorting the rows: each row's floor, the least likely value top-p keeps.

For each row of ``x [S, V]`` fp32 (tokens dropped by earlier filters below the row's ``floor_in``),
a token stays while the mass of the tokens strictly more likely than it is < ``top_p`` of the mass
of the tokens >= ``floor_in`` (tied tokens stay or go together). So the kept tokens are those
``>= t``, with ``t`` the smallest value whose mass strictly above it is < ``top_p * Z``. The search
for ``t`` runs over int32 keys ordered as the fp32 values (``-0.0`` read as ``+0.0``: they tie);
each pass sums the masses above ``NC - 1`` keys that cut the row's bracket ``[lo, hi]`` into ``NC``
parts, so ``passes(NC)`` passes settle any bracket of 32-bit keys (11 of 8 cuts; a sort of 64 x 128K values
cost ~2 ms).

The masses are libdevice's ``expf`` (torch's CUDA ``exp``: the same bits) of ``x - max`` summed in
fp64: the kept set is the rule's up to the fp32 exponentials' rounding, where an fp32 cumsum over
a sorted row (vLLM's and our former path) rounds ~1e-6 of the mass and keeps another set in ~1% of
long-tail rows.

Launches, over (row, chunk of columns) programs: ``_top_p_max_kernel`` (each chunk's max of the
kept values), then ``_top_p_pass_kernel`` once per pass: each program folds the last pass's chunk
masses (in chunk order: deterministic) into the row's bracket - every program of the row the same
- and sums its chunk's masses above the new keys; the last one writes the floor. Brackets and
masses are double-buffered by the pass's parity, so no program reads what its own launch writes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from paged_backend.kernels.dispatch import INTERPRET, num_sms

NC = 8  # a power of two: column 0, the row's mass Z; 1..NC-1, the mass above each cut of the bracket


def passes(nc: int) -> int:
    """Passes that settle any bracket of int32 keys (width < 2^32): each leaves at most w / nc of a
    bracket of width w (8 for 16 cuts)."""
    return -(-32 // (nc.bit_length() - 1))


# values a program reads at once ([rows, NC, values] fp64 partial sums in registers); the interpreter
# runs a program's block as one numpy operation, so it takes far larger blocks (fewer programs: the
# sampler's 20,000-row tests 5x faster). BLOCK 512, 4 warps, 8 cuts (11 passes): the fastest of ten
# settings on the H200 on 64 and 256 rows of 49,152 and 128,256 values (1.23-1.27x 256 x 4 x 16;
# one row of 128,256: 43.8 vs 40.6 us; benchmarks/results/sweeps/top_p_layout_sweep_h200.md)
BLOCK = 65536 if INTERPRET else 512
NUM_WARPS = 4


@triton.jit
def _key(x):
    """fp32 -> int32 ordered as the values (-inf to +inf; -0.0 as +0.0)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _top_p_max_kernel(x_ptr, floor_ptr, pmax_ptr, S, V, SPLIT, CHUNK, stride_xs,
                      BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr):
    # Program (block of rows, chunk of columns): each row's max of the chunk's values >= its floor.
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    chunk = tl.program_id(1)
    r_ok = rows < S
    rows = rows.to(tl.int64)
    floor = tl.load(floor_ptr + rows, mask=r_ok, other=0.0)
    mx = tl.full([BLOCK_S, BLOCK_V], float("-inf"), tl.float32)
    for start in range(chunk * CHUNK, tl.minimum(V, (chunk + 1) * CHUNK), BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + rows[:, None] * stride_xs + v[None, :], mask=r_ok[:, None] & (v < V)[None, :],
                    other=float("-inf"))
        mx = tl.maximum(mx, tl.where(x >= floor[:, None], x, float("-inf")))
    tl.store(pmax_ptr + rows * SPLIT + chunk, tl.max(mx, 1), mask=r_ok)


@triton.jit
def _top_p_pass_kernel(x_ptr, floor_ptr, top_p_ptr, pmax_ptr, bracket_ptr, mass_ptr, out_ptr, S, V, SPLIT, CHUNK,
                       stride_xs, PASS: tl.constexpr, LAST: tl.constexpr, NC: tl.constexpr, SPLIT_P2: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    chunk = tl.program_id(1)
    r_ok = rows < S
    rows = rows.to(tl.int64)
    j = tl.arange(0, NC)
    c = tl.arange(0, SPLIT_P2)
    floor = tl.load(floor_ptr + rows, mask=r_ok, other=0.0)
    top_p = tl.load(top_p_ptr + rows, mask=r_ok, other=1.0)
    m = tl.max(tl.load(pmax_ptr + rows[:, None] * SPLIT + c[None, :], mask=r_ok[:, None] & (c < SPLIT)[None, :],
                       other=float("-inf")), 1)  # [BLOCK_S] each row's max
    if PASS == 0:  # the bracket: the floor's key (the mass above key - 1 is Z >= goal) to the max's (0 < goal)
        lo = _key(floor).to(tl.int64)
        hi = tl.where(top_p >= 1.0, lo, tl.maximum(_key(m).to(tl.int64), lo))  # (top-p off: the floor stays)
    else:  # the last pass's masses (its chunks in order) narrow its bracket
        prev = ((PASS - 1) % 2) * S * 2
        lo = tl.load(bracket_ptr + prev + rows * 2, mask=r_ok, other=0)
        hi = tl.load(bracket_ptr + prev + rows * 2 + 1, mask=r_ok, other=0)
        at = ((PASS - 1) % 2) * S * SPLIT * NC + (rows[:, None, None] * SPLIT + c[None, :, None]) * NC + j[None, None, :]
        mass = tl.sum(tl.load(mass_ptr + at, mask=r_ok[:, None, None] & (c < SPLIT)[None, :, None], other=0.0), 1)
        goal = top_p.to(tl.float64) * tl.sum(tl.where(j[None, :] == 0, mass, 0.0), 1)  # [BLOCK_S]
        cut = lo[:, None] + ((hi - lo)[:, None] * j[None, :]) // NC  # [BLOCK_S, NC]
        under = (mass < goal[:, None]) & (j[None, :] > 0)  # the answer is <= cut; else > cut
        settled = hi <= lo
        new_hi = tl.min(tl.where(under, cut, hi[:, None]), 1)
        lo = tl.where(settled, lo, tl.max(tl.where(under | (j[None, :] == 0), lo[:, None], cut + 1), 1))
        hi = tl.where(settled, hi, new_hi)
    if LAST:
        b = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.int32)
        tl.store(out_ptr + rows, b.to(tl.float32, bitcast=True), mask=r_ok)
    else:
        if chunk == 0:
            tl.store(bracket_ptr + (PASS % 2) * S * 2 + rows * 2, lo, mask=r_ok)
            tl.store(bracket_ptr + (PASS % 2) * S * 2 + rows * 2 + 1, hi, mask=r_ok)
        # [rows, NC, values]: the values along the threads, so each thread converts its values to fp64
        # once and adds them under every cut (NC along the threads converted each value 16 times
        # and moved it through shared memory every iteration: 298 instructions a loop vs 173)
        acc = tl.zeros([BLOCK_S, NC, BLOCK_V], tl.float64)
        live = r_ok & (hi > lo)  # (a settled row needs no masses)
        if tl.max(live.to(tl.int32), 0) > 0:
            cut32 = (lo[:, None] + ((hi - lo)[:, None] * j[None, :]) // NC).to(tl.int32)  # [BLOCK_S, NC]
            m_safe = tl.where(m == float("-inf"), 0.0, m)  # (nothing kept: every mass 0, no NaN)
            for start in range(chunk * CHUNK, tl.minimum(V, (chunk + 1) * CHUNK), BLOCK_V):
                v = start + tl.arange(0, BLOCK_V)
                x = tl.load(x_ptr + rows[:, None] * stride_xs + v[None, :], mask=live[:, None] & (v < V)[None, :],
                            other=float("-inf"))
                x = tl.where(x >= floor[:, None], x, float("-inf"))
                if LIBDEVICE:  # libdevice's expf is torch's CUDA exp: the torch version's masses
                    e = libdevice.exp(x - m_safe[:, None])
                else:  # (the interpreter has no libdevice)
                    e = tl.exp(x - m_safe[:, None])
                above = (_key(x)[:, None, :] > cut32[:, :, None]) | (j == 0)[None, :, None]
                acc += tl.where(above, e.to(tl.float64)[:, None, :], 0.0)
        at = (PASS % 2) * S * SPLIT * NC + (rows[:, None] * SPLIT + chunk) * NC + j[None, :]
        tl.store(mass_ptr + at, tl.sum(acc, 2), mask=r_ok[:, None])


def top_p_floor_triton(x: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``paged_backend.top_p.top_p_floor`` (inputs checked there): x [S, V] fp32 with unit stride
    along V, floor [S] fp32, top_p [S] fp32 -> [S] fp32 each row's floor after top-p."""
    s, v = x.shape
    dev = x.device
    block_v = min(BLOCK, triton.next_power_of_2(v))
    block_s = min(BLOCK // block_v, triton.next_power_of_2(s))  # (small vocabularies: rows share a program)
    row_blocks = triton.cdiv(s, block_s)
    # ~2 programs per SM, each >= block_v values of a row
    split = max(1, min(triton.cdiv(v, block_v), triton.cdiv(2 * num_sms(dev), row_blocks)))
    chunk = triton.cdiv(triton.cdiv(v, split), block_v) * block_v
    split = triton.cdiv(v, chunk)
    pmax = torch.empty((s, split), dtype=torch.float32, device=dev)
    bracket = torch.empty((2, s, 2), dtype=torch.int64, device=dev)
    mass = torch.empty((2, s, split, NC), dtype=torch.float64, device=dev)
    out = torch.empty(s, dtype=torch.float32, device=dev)
    grid = (row_blocks, split)
    blocks = dict(BLOCK_S=block_s, BLOCK_V=block_v)
    _top_p_max_kernel[grid](x, floor, pmax, s, v, split, chunk, x.stride(0), **blocks, num_warps=NUM_WARPS)
    n = passes(NC)
    for p in range(n + 1):
        last = p == n
        _top_p_pass_kernel[(row_blocks, 1) if last else grid](
            x, floor, top_p, pmax, bracket, mass, out, s, v, split, chunk, x.stride(0), PASS=p, LAST=last, NC=NC,
            SPLIT_P2=triton.next_power_of_2(split), **blocks, LIBDEVICE=not INTERPRET, num_warps=NUM_WARPS)
    return out
