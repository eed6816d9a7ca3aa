"""Top-p without sorting the rows: what a threshold search would cost and how often it would keep
other tokens than the sampler's sorted path.

Why: top-p alone (the common ``top_p=0.9`` / ``0.95``) still sorts every row (``_top_k_top_p``):
64 x 49,152 or 64 x 128,256 fp32 values with their indices a step. Top-k (with or without top-p)
reads a ``torch.topk`` window instead, bit for bit the sorted path, but top-p alone keeps an
unbounded set. A token stays while the mass of the tokens strictly more likely than it is below
``top_p``, so the kept set is ``x >= t*`` with ``t*`` the smallest logit whose mass above it is below
``top_p``; ``_threshold_kernel`` finds it by a bisection over the fp32 values' ordered bit patterns
(32 passes over the row, from L2), with the masses summed in its own order - so where the sorted
path's cumsum and this sum round apart at the boundary, the kept sets differ. This probe measures
both: the time (a CUDA graph each) and the share of rows whose kept sets differ, on logits shaped
like a language model's (a few dominant tokens over a long tail, bf16-rounded) at several
temperatures and ``top_p`` levels. Library code changes only on its answer.

    python3 benchmarks/top_p_threshold_check.py            # on a GPU; ~20 s
    TRITON_INTERPRET=1 python3 benchmarks/top_p_threshold_check.py --quick   # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from paged_backend.integration.sampler import _top_k_top_p  # noqa: E402

BLOCK = 4096
KEY_NEG_INF = -2139095041  # _key(-inf)


@triton.jit
def _key(x):
    """fp32 -> int32 whose order is the values' (finite values and -inf)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _mass_above(x_ptr, row, V, m, t_key, BLOCK: tl.constexpr):
    """sum of exp(x - m) over the row's values whose key is > ``t_key``."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + v, mask=v < V, other=float("-inf"))
        acc += tl.where(_key(x) > t_key, tl.exp(x - m), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _threshold_kernel(x_ptr, top_p_ptr, out_ptr, V, KEY_NEG_INF: tl.constexpr, BLOCK: tl.constexpr):
    # Program: one row. t* = the smallest value whose mass above it is < top_p (Z the row's total).
    row = tl.program_id(0).to(tl.int64)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        mx = tl.maximum(mx, tl.load(x_ptr + row * V + v, mask=v < V, other=float("-inf")))
    m = tl.max(mx, 0)
    z = _mass_above(x_ptr, row, V, m, -2147483647 - 1, BLOCK)
    goal = tl.load(top_p_ptr + row) * z
    # keys lo..hi (-inf's key, the max's): mass_above(hi) = 0 < goal; find the smallest key with
    # mass_above(key) < goal
    lo = tl.full([], KEY_NEG_INF, tl.int64)
    hi = _key(m).to(tl.int64)
    for _ in range(33):  # (the key range spans < 2^33)
        if lo < hi:
            mid = lo + (hi - lo) // 2
            if _mass_above(x_ptr, row, V, m, mid.to(tl.int32), BLOCK) < goal:
                hi = mid
            else:
                lo = mid + 1
    tl.store(out_ptr + row, hi.to(tl.int32))


def threshold_keep(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [S, V] fp32 contiguous, top_p [S] -> x with the tokens under each row's threshold as -inf."""
    s, v = x.shape
    keys = torch.empty(s, dtype=torch.int32, device=x.device)
    _threshold_kernel[(s,)](x, top_p, keys, v, KEY_NEG_INF=KEY_NEG_INF, BLOCK=min(BLOCK, triton.next_power_of_2(v)),
                            num_warps=8)
    bits = x.view(torch.int32)
    xkey = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return x.masked_fill(xkey < keys[:, None], float("-inf"))


def lm_logits(s: int, v: int, temperature: float, g: torch.Generator, device) -> torch.Tensor:
    """Rows shaped like a language model's: a long Gaussian tail, a few tokens far above it, bf16-rounded,
    divided by the temperature in fp32 (the sampler's x)."""
    x = torch.randn(s, v, generator=g) * 2.0
    top = torch.randint(0, v, (s, 8), generator=g)
    x.scatter_(1, top, 8.0 + 4.0 * torch.rand(s, 8, generator=g))
    return (x.bfloat16().float() / temperature).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run under TRITON_INTERPRET=1)")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = [(4, 1000)] if a.quick else [(64, 49152), (64, 128256)]
    g = torch.Generator().manual_seed(0)
    rows = []
    for s, v in cases:
        k = torch.full((s,), v, dtype=torch.int64, device=device)  # (no top-k)
        for temperature in (0.7, 1.0, 1.3):
            for level in (0.9, 0.95):
                top_p = torch.full((s,), level, device=device)
                differ = 0
                for _ in range(2 if a.quick else 8):
                    x = lm_logits(s, v, temperature, g, device)
                    got, want = threshold_keep(x, top_p), _top_k_top_p(x, k, top_p)
                    differ += int((torch.isfinite(got) != torch.isfinite(want)).any(dim=1).sum())
                total = s * (2 if a.quick else 8)
                t_sort = t_thr = None
                if device.type == "cuda":
                    t_sort = C.graph_time_us([lambda: _top_k_top_p(x, k, top_p)])
                    t_thr = C.graph_time_us([lambda: threshold_keep(x, top_p)])
                kept = float(torch.isfinite(want).sum(dim=1).float().mean())
                rows.append([f"{s} x {v}", temperature, level, f"{kept:.0f}", f"{differ} / {total}",
                             "" if t_sort is None else f"{t_sort:.1f}", "" if t_thr is None else f"{t_thr:.1f}"])
    print(C.gpu_name(device) if device.type == "cuda" else "cpu (a smoke run)", C.now())
    print(C.md_table(["rows x vocabulary", "temperature", "top_p", "tokens kept (mean)", "rows kept otherwise",
                      "sorted path (us, graph)", "threshold search (us, graph)"], rows))


if __name__ == "__main__":
    main()
