"""Top-p (nucleus) filtering as a per-row floor, without sorting the rows on the GPU.

``top_p_floor(x, floor, top_p)`` -> for each row of ``x [S, V]`` fp32 whose tokens below
``floor [S]`` are already dropped (min-p, top-k; ``-inf``: none), the least likely value top-p
keeps: a token stays while the mass of the tokens strictly more likely than it is < ``top_p [S]``
of the mass of the tokens >= ``floor`` (vLLM v1's rule; tied tokens stay or go together, the most
likely token always stays). ``x >= result`` is the kept set; rows with ``top_p >= 1`` (``inf``:
off) keep ``floor``. Masses are ``exp(x - max)`` in fp32 summed in fp64, on both paths: a search over
the values' ordered bit patterns in Triton (``kernels/top_p.py``) on CUDA tensors and under
``TRITON_INTERPRET=1``, the sorted fp64 cumsum below elsewhere (the same set: on the GPU both take
torch's ``exp`` bits, and fp64 sums in two orders differ by ~1e-16 of the mass).
"""
from __future__ import annotations

import torch

from paged_backend.kernels.checks import check_tensor
from paged_backend.kernels.dispatch import use_triton


def top_p_floor(x: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [S, V] fp32, floor [S] fp32, top_p [S] fp32 in (0, 1] or >= 1 for off, all on one device
    -> [S] fp32, each >= the row's ``floor`` (see the module doc)."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32,))
    s = x.shape[0]
    for name, t in (("floor", floor), ("top_p", top_p)):
        check_tensor(name, t, ndim=1, dtypes=(torch.float32,), device=x.device)
        if t.shape[0] != s:
            raise ValueError(f"{name} must have {s} entries (one per row of x), got {t.shape[0]}")
    if s == 0 or x.shape[1] == 0:
        return floor.clone()
    if use_triton(x):
        from paged_backend.kernels.top_p import top_p_floor_triton
        return top_p_floor_triton(x if x.stride(1) == 1 else x.contiguous(), floor.contiguous(), top_p.contiguous())
    return top_p_floor_torch(x, floor, top_p)


def top_p_floor_torch(x: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The same floors from each row sorted: the mass ahead of each tie group, an fp64 cumsum."""
    neg = float("-inf")
    x = torch.where(x >= floor[:, None], x, neg)
    x = torch.where(x == 0, 0.0, x)  # (-0.0 ties +0.0)
    # on the CPU (no device to wait for) only as many values as a row keeps at most are sorted; on a
    # GPU this version is the search's reference, without a sync (a CUDA graph holds it)
    w = max(1, int((x > neg).sum(dim=-1).max())) if x.device.type == "cpu" else x.shape[1]
    if w < x.shape[1]:
        srt = torch.topk(x, w, dim=-1).values  # [S, W] descending
    else:
        srt = torch.sort(x, dim=-1, descending=True).values  # [S, V]
    m = srt[:, :1]
    e = torch.exp(srt - torch.where(m == neg, 0.0, m)).double()  # [S, V]
    before = torch.cumsum(e, dim=-1) - e  # mass of the tokens sorted ahead (exact enough in fp64)
    rank = torch.arange(srt.shape[1], device=x.device).expand_as(srt)
    starts = torch.ones_like(srt, dtype=torch.bool)
    starts[:, 1:] = srt[:, 1:] != srt[:, :-1]
    first = torch.cummax(torch.where(starts, rank, 0), dim=-1).values  # each token's tie group's first
    ahead = torch.cummax(before.gather(1, first), dim=-1).values  # (non-decreasing: the kept form a prefix)
    kept = ahead < top_p.double()[:, None] * e.sum(dim=-1, keepdim=True)
    last = srt.gather(1, kept.sum(dim=-1, keepdim=True).clamp(min=1) - 1)[:, 0]
    return torch.where(top_p >= 1.0, floor, torch.maximum(last, floor))
