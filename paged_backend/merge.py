"""Public merging of attention states (natural-log LSE)."""
from __future__ import annotations

import torch

from paged_backend.kernels.checks import FLOAT_DTYPES, check_shape, check_tensor
from paged_backend.kernels.dispatch import use_triton
from paged_backend.kernels.merge import merge_torch, merge_triton


def _check_state(name_o: str, o, name_lse: str, lse, device=None):
    check_tensor(name_o, o, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_tensor(name_lse, lse, ndim=2, dtypes=(torch.float32,), device=o.device)
    check_shape(name_lse, lse, tuple(o.shape[:2]))


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two states over disjoint key sets.

    o_a, o_b [T, Hq, D] (same dtype), lse_a, lse_b [T, Hq] float32 natural log
    -> (o [T, Hq, D] in o_a's dtype, lse [T, Hq] float32). Exact and associative up to rounding;
    an empty state (lse = -inf) is the identity.
    """
    _check_state("o_a", o_a, "lse_a", lse_a)
    _check_state("o_b", o_b, "lse_b", lse_b, device=o_a.device)
    check_shape("o_b", o_b, tuple(o_a.shape))
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"o_b dtype {o_b.dtype} must equal o_a dtype {o_a.dtype}")
    out = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    out_lse = torch.empty(lse_a.shape, dtype=torch.float32, device=o_a.device)
    if use_triton(o_a):
        merge_triton(o_a[None], lse_a[None], out, out_lse, o_b=o_b, lse_b=lse_b)
    else:
        merge_torch(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]), out, out_lse)
    return out, out_lse


def merge_states_many(o_stack: torch.Tensor, lse_stack: torch.Tensor):
    """Merge N states: o_stack [N, T, Hq, D], lse_stack [N, T, Hq] float32 natural log
    -> (o [T, Hq, D], lse [T, Hq] float32). States are folded in index order (deterministic)."""
    check_tensor("o_stack", o_stack, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("lse_stack", lse_stack, ndim=3, dtypes=(torch.float32,), device=o_stack.device)
    check_shape("lse_stack", lse_stack, tuple(o_stack.shape[:3]))
    if o_stack.shape[0] < 1:
        raise ValueError("o_stack must hold at least one state (N >= 1)")
    out = torch.empty(o_stack.shape[1:], dtype=o_stack.dtype, device=o_stack.device)
    out_lse = torch.empty(lse_stack.shape[1:], dtype=torch.float32, device=o_stack.device)
    fn = merge_triton if use_triton(o_stack) else merge_torch
    fn(o_stack, lse_stack, out, out_lse)
    return out, out_lse
