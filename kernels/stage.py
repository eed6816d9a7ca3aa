"""Kernels at the two ends of a captured decode step: its inputs read from pinned host memory, and
its drawn tokens written back into it.

Between two CUDA graphs a step used to run a device-to-host copy of the last step's tokens and two
host-to-device copies of the next step's inputs, each on the copy engine behind the graph before
it (H200, 2026-11-29: a graph of 20 small kernels took 29.8 us, 41.4 with one such copy between
replays, 50.5 with three; a kernel reading the same 96 KB from pinned memory 34.4). With these two
kernels as a graph's first and last nodes the device runs nothing but kernels between steps.

Pinned host memory is mapped into the device's address space (unified addressing), so a kernel
loads and stores it directly; each program moves one block (the loads cross PCIe: many programs,
one round trip each).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_in_kernel(src_ptr, dst_ptr, head_start, head_end, head_programs, cols_at, table_at, width,
                    BLOCK: tl.constexpr):
    # int32 words. Programs [0, head_programs): one block each of src[head_start:head_end], to the
    # same offsets of dst. Program head_programs + r: row r of a table of `width` columns at
    # dst[table_at:], its first c = src[cols_at] words from src[table_at + r * c:] (the host sends only
    # the columns a step uses, and c with them: a captured launch copies whatever each step sent).
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if pid < head_programs:
        at = head_start + pid * BLOCK + offs
        tl.store(dst_ptr + at, tl.load(src_ptr + at, mask=at < head_end), mask=at < head_end)
    else:
        r = (pid - head_programs).to(tl.int64)
        c = tl.load(src_ptr + cols_at)
        for start in range(0, c, BLOCK):
            col = start + offs
            ok = col < c
            tl.store(dst_ptr + table_at + r * width + col, tl.load(src_ptr + table_at + r * c + col, mask=ok),
                     mask=ok)


@triton.jit
def _publish_kernel(tokens_ptr, logprobs_ptr, ids_ptr, parity_ptr, host_ptr, S, BLOCK: tl.constexpr):
    # tokens [S] int64 -> ids [S] (the next step's input ids, on the device) and, with logprobs [S]
    # fp32, host [2, S, 2] float64 at half parity (the host reads one half while the next step
    # writes the other).
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < S
    tok = tl.load(tokens_ptr + r, mask=ok)
    tl.store(ids_ptr + r, tok, mask=ok)
    half = tl.load(parity_ptr).to(tl.int64) * S * 2
    tl.store(host_ptr + half + 2 * r, tok.to(tl.float64), mask=ok)
    tl.store(host_ptr + half + 2 * r + 1, tl.load(logprobs_ptr + r, mask=ok).to(tl.float64), mask=ok)


def copy_in(src, dst, head_start: int, head_end: int, table_at: int = 0, rows: int = 0, width: int = 0,
            cols_at: int = 0, block: int = 1024) -> None:
    """``_copy_in_kernel`` on int32 views ``src`` (pinned host) and ``dst`` (device): words
    ``[head_start, head_end)`` as they are, then ``rows`` table rows (see the kernel)."""
    programs = triton.cdiv(head_end - head_start, block)
    _copy_in_kernel[(programs + rows,)](src, dst, head_start, head_end, programs, cols_at, table_at, width,
                                        BLOCK=block, num_warps=4)


def publish(tokens, logprobs, ids, parity, host) -> None:
    """``_publish_kernel``: tokens [S] int64 and logprobs [S] fp32 on the device -> ids [S] int64 (device)
    and host [2, S, 2] float64 (pinned) at half ``parity`` ([1] int32 on the device)."""
    s = tokens.shape[0]
    block = min(1024, triton.next_power_of_2(max(s, 16)))
    _publish_kernel[(triton.cdiv(s, block),)](tokens, logprobs, ids, parity, host, s, BLOCK=block, num_warps=4)
