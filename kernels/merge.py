"""Merging attention states ``(o, lse)``: two states, or a stack of N along a leading axis.

A state summarises attention over a key set: ``o`` is the softmax-weighted value sum and ``lse``
the natural-log sum of exp(scores). Two states over disjoint key sets merge exactly::

    m = max(lse_a, lse_b);  w_a = exp(lse_a - m);  w_b = exp(lse_b - m)
    o = (w_a o_a + w_b o_b) / (w_a + w_b);  lse = m + log(w_a + w_b)

An empty key set has ``lse = -inf`` (and ``o = 0``); merging with it is the identity, and two
empty states merge to an empty state, never NaN. ``lse = +inf`` (FlashAttention-2's mark of an
empty row) is read as ``-inf``, as vLLM's merge does; a state of weight 0 adds nothing, whatever
its ``o`` holds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def merge_step(m, w_sum, acc, lse, o):
    """Folds one state (lse [R], o [R, D]) into a running merge (m [R], w_sum [R], acc [R, D]),
    all fp32, natural log. Start from m = -inf, w_sum = 0, acc = 0. ``lse = +inf`` is an empty
    state (FlashAttention-2's mark), like -inf."""
    lse = tl.where(lse == float("inf"), float("-inf"), lse)
    m_new = tl.maximum(m, lse)
    # While both are -inf the row is still empty: shift by 0 so exp(-inf - 0) = 0, never NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse - m_safe)
    # An empty state adds nothing even where its o is not 0 (0 * NaN would be NaN).
    return m_new, w_sum * alpha + w, acc * alpha[:, None] + tl.where(w[:, None] > 0.0, o * w[:, None], 0.0)


@triton.jit
def merge_finish(m, w_sum, acc):
    """-> (o [R, D], lse [R]); an empty merge gives o = 0, lse = -inf."""
    empty = w_sum == 0.0
    o = acc / tl.where(empty, 1.0, w_sum)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, w_sum)))
    return o, lse


@triton.jit
def _row_tile(R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's BLOCK_R rows (int64) of an [R, D] row set -> (rows, offs_d, row_ok, mask)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    return rows, offs_d, row_ok, row_ok[:, None] & (offs_d[None, :] < D)


@triton.jit
def _merge_states_kernel(
    o_ptr, lse_ptr, ob_ptr, lseb_ptr, out_ptr, out_lse_ptr,
    N, R, H,
    stride_on, stride_ot, stride_oh, stride_od,
    stride_ln, stride_lt, stride_lh,
    stride_obt, stride_obh, stride_obd,
    stride_lbt, stride_lbh,
    stride_outt, stride_outh, stride_outd,
    stride_olt, stride_olh,
    HAS_B: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program merges BLOCK_R rows (a row = one (token, head)) over the N stacked states and,
    # with HAS_B, one more state held in its own tensors (two-state merges need no stacking copy).
    rows, offs_d, row_ok, mask = _row_tile(R, D, BLOCK_R, BLOCK_D)
    t = rows // H
    h = rows % H
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for n in range(N):
        lse = tl.load(lse_ptr + n * stride_ln + t * stride_lt + h * stride_lh, mask=row_ok,
                      other=float("-inf")).to(tl.float32)
        o = tl.load(o_ptr + n * stride_on + t[:, None] * stride_ot + h[:, None] * stride_oh
                    + offs_d[None, :] * stride_od, mask=mask, other=0.0).to(tl.float32)
        m, w_sum, acc = merge_step(m, w_sum, acc, lse, o)
    if HAS_B:
        lse = tl.load(lseb_ptr + t * stride_lbt + h * stride_lbh, mask=row_ok, other=float("-inf"))
        o = tl.load(ob_ptr + t[:, None] * stride_obt + h[:, None] * stride_obh + offs_d[None, :] * stride_obd,
                    mask=mask, other=0.0).to(tl.float32)
        m, w_sum, acc = merge_step(m, w_sum, acc, lse, o)
    out, lse_out = merge_finish(m, w_sum, acc)
    tl.store(out_ptr + t[:, None] * stride_outt + h[:, None] * stride_outh + offs_d[None, :] * stride_outd,
             out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_lse_ptr + t * stride_olt + h * stride_olh, lse_out, mask=row_ok)


def merge_triton(o_stack: torch.Tensor, lse_stack: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor,
                 o_b: torch.Tensor | None = None, lse_b: torch.Tensor | None = None):
    """o_stack [N, T, H, D], lse_stack [N, T, H] (and optionally one more state o_b [T, H, D],
    lse_b [T, H], merged last) -> writes out [T, H, D], out_lse [T, H]."""
    n, t, h, d = o_stack.shape
    rows = t * h
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(16, 4096 // block_d))
    grid = (triton.cdiv(rows, block_r),)
    if rows == 0:
        return
    has_b = o_b is not None
    o_b, lse_b = (o_b, lse_b) if has_b else (out, out_lse)  # placeholders, never read
    _merge_states_kernel[grid](
        o_stack, lse_stack, o_b, lse_b, out, out_lse, n, rows, h,
        *o_stack.stride(), *lse_stack.stride(), *o_b.stride(), *lse_b.stride(),
        *out.stride(), *out_lse.stride(),
        HAS_B=has_b, D=d, BLOCK_R=block_r, BLOCK_D=block_d,
    )


def merge_torch(o_stack: torch.Tensor, lse_stack: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor):
    """Vectorised torch version of :func:`merge_triton` (CPU tensors)."""
    lse = lse_stack.float().masked_fill(lse_stack == float("inf"), float("-inf"))  # +inf: empty
    m = lse.max(dim=0).values  # [T, H]
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # [N, T, H]; exp(-inf) = 0
    w_sum = w.sum(dim=0)
    empty = w_sum == 0
    acc = torch.where(w[..., None] > 0, o_stack.float() * w[..., None], 0.0).sum(dim=0)
    out.copy_(acc / torch.where(empty, torch.ones_like(w_sum), w_sum)[..., None])
    out_lse.copy_(torch.where(empty, torch.full_like(m, float("-inf")),
                              m_safe + torch.log(torch.where(empty, torch.ones_like(w_sum), w_sum))))


# ----------------------------------------------------------------------------------------------
# Cross-rank merging (paged_backend.parallel): kernels that read/write the collectives' packed
# buffers directly, so a merge costs one launch on each side of the collective. Rows (a row = one
# (token, head)) are contiguous: o row r at r * D, lse at r.

def rows_config(rows: int, d: int):
    """(grid, BLOCK_R, BLOCK_D) of the row kernels below (compute once per shape)."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(16, 4096 // block_d))
    return (triton.cdiv(rows, block_r),), block_r, block_d


@triton.jit
def _merge_gathered_kernel(lse_ptr, o_ptr, out_ptr, out_lse_ptr, N, R, stride_ln, stride_on,
                           D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # N states laid out one after the other with element strides stride_ln / stride_on (e.g. the
    # per-rank rows of an all-gather buffer), folded in index order; contiguous rows otherwise.
    rows, offs_d, row_ok, mask = _row_tile(R, D, BLOCK_R, BLOCK_D)
    lse_p = lse_ptr + rows
    o_p = o_ptr + rows[:, None] * D + offs_d[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for _ in range(N):
        lse = tl.load(lse_p, mask=row_ok, other=float("-inf")).to(tl.float32)
        o = tl.load(o_p, mask=mask, other=0.0).to(tl.float32)
        m, w_sum, acc = merge_step(m, w_sum, acc, lse, o)
        lse_p += stride_ln  # pointer increments: 64-bit, no n * stride overflow
        o_p += stride_on
    out, lse_out = merge_finish(m, w_sum, acc)
    tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_lse_ptr + rows, lse_out, mask=row_ok)


def merge_gathered_triton(lse_all: torch.Tensor, o_all: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor,
                          cfg=None):
    """lse_all [N, T, H] fp32, o_all [N, T, H, D]: per-state strides free, each state's rows contiguous
    (``stride(-1) == 1``, ``stride(-2) == D``, ``stride(-3) == H*D``; lse likewise); out [T, H, D],
    out_lse [T, H] contiguous. ``cfg``: :func:`rows_config` of ``(T*H, D)``, to skip recomputing it."""
    n, t, h, d = o_all.shape
    if t * h == 0:
        return
    grid, block_r, block_d = cfg or rows_config(t * h, d)
    _merge_gathered_kernel[grid](lse_all, o_all, out, out_lse, n, t * h, lse_all.stride(0), o_all.stride(0),
                                 D=d, BLOCK_R=block_r, BLOCK_D=block_d)


@triton.jit
def _weigh_pack_kernel(o_ptr, lse_ptr, m_ptr, buf_ptr, R,
                       D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # buf[r] = [o[r] * w | w], w = exp(lse[r] - m[r]) (m = the max over ranks; shift by 0 where it
    # is -inf, so empty rows give w = 0, never NaN; lse = +inf is empty too). buf rows are D + 1 fp32.
    rows, offs_d, row_ok, mask = _row_tile(R, D, BLOCK_R, BLOCK_D)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("-inf"))
    lse = tl.where(lse == float("inf"), float("-inf"), lse)
    m = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(o_ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(buf_ptr + rows[:, None] * (D + 1) + offs_d[None, :], tl.where(w[:, None] > 0.0, o * w[:, None], 0.0),
             mask=mask)
    tl.store(buf_ptr + rows * (D + 1) + D, w, mask=row_ok)


@triton.jit
def _weigh_finish_kernel(buf_ptr, m_ptr, out_ptr, out_lse_ptr, R,
                         D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # After the sum over ranks: o = sum(o*w) / sum(w), lse = m + log(sum(w)); empty rows: 0, -inf.
    rows, offs_d, row_ok, mask = _row_tile(R, D, BLOCK_R, BLOCK_D)
    m = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
    w_sum = tl.load(buf_ptr + rows * (D + 1) + D, mask=row_ok, other=0.0)
    acc = tl.load(buf_ptr + rows[:, None] * (D + 1) + offs_d[None, :], mask=mask, other=0.0)
    out, lse = merge_finish(tl.where(m == float("-inf"), 0.0, m), w_sum, acc)
    tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_lse_ptr + rows, lse, mask=row_ok)


def weigh_pack_triton(o, lse, m, buf, cfg=None):
    """o [T, H, D], lse [T, H], m [T, H] fp32 (the max of lse over ranks), all contiguous
    -> buf [T, H, D + 1] fp32 = ``[o * w | w]``, ``w = exp(lse - m)`` (0 for empty rows)."""
    t, h, d = o.shape
    if t * h == 0:
        return
    grid, block_r, block_d = cfg or rows_config(t * h, d)
    _weigh_pack_kernel[grid](o, lse, m, buf, t * h, D=d, BLOCK_R=block_r, BLOCK_D=block_d)


def weigh_finish_triton(buf, m, out, out_lse, cfg=None):
    """buf [T, H, D + 1] fp32 = ``[sum o*w | sum w]``, m [T, H] -> out [T, H, D] (its dtype),
    out_lse [T, H] fp32 (all contiguous)."""
    t, h, d = out.shape
    if t * h == 0:
        return
    grid, block_r, block_d = cfg or rows_config(t * h, d)
    _weigh_finish_kernel[grid](buf, m, out, out_lse, t * h, D=d, BLOCK_R=block_r, BLOCK_D=block_d)


def weigh_pack_torch(o, lse, m, buf):
    """Torch version of :func:`weigh_pack_triton` (CPU tensors; any strides)."""
    d = o.shape[-1]
    w = torch.exp(lse.masked_fill(lse == float("inf"), float("-inf")) - torch.where(m == float("-inf"), 0.0, m))
    torch.mul(o, w[..., None], out=buf[..., :d])
    buf[..., :d].masked_fill_(w[..., None] == 0, 0.0)  # an empty state adds nothing, even a NaN o
    buf[..., d] = w


def weigh_finish_torch(buf, m, out, out_lse):
    """Torch version of :func:`weigh_finish_triton` (CPU tensors)."""
    d = out.shape[-1]
    w_sum = buf[..., d]
    empty = w_sum == 0.0
    w_sum = torch.where(empty, 1.0, w_sum)
    out.copy_(buf[..., :d] / w_sum[..., None])
    out_lse.copy_(torch.where(empty, float("-inf"), torch.where(m == float("-inf"), 0.0, m) + torch.log(w_sum)))
