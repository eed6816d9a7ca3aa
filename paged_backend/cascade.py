"""Public cascade (shared-prefix) decode: ``plan_cascade`` once per step, ``cascade_decode`` per layer.

A prefix shared by n requests (found from identical leading block ids, or given by the scheduler
as groups) is read once and attended by all n requests as one tensor-core GEMM, spread stream-K
over the GPU; each request's private tail runs as decode; the states merge exactly. See
docs/cascade.md and :mod:`paged_backend.cascade_plan`.
"""
from __future__ import annotations

import torch

from kernels.cascade import cascade_torch, cascade_triton
from kernels.checks import check_attention_inputs, check_plan_matches
from kernels.decode import decode_triton
from kernels.dispatch import use_triton
from paged_backend.cascade_plan import CascadeCost, CascadePlan, plan_cascade

__all__ = ["CascadePlan", "CascadeCost", "plan_cascade", "cascade_decode"]


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cplan: CascadePlan,
                   return_lse: bool = True, scale: float | None = None):
    """Decode attention of one query token per request, sharing the plan's prefixes.

    q [B, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D] (any strides); ``cplan`` from
    :func:`plan_cascade` for this step (it holds the block table and lengths). Returns
    ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32 natural log)``, or ``out`` alone when
    ``return_lse=False``. A request of length 0 gives out = 0, lse = -inf. Exact (equal to flat
    decode up to rounding) and deterministic.
    """
    if not isinstance(cplan, CascadePlan):
        raise TypeError(f"cplan must be a CascadePlan from pb.plan_cascade, got {type(cplan).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    nb, bs, hkv, d, hq, scale = check_attention_inputs(q, k_cache, v_cache, scale)
    batch = q.shape[0]
    check_plan_matches("cplan", cplan, q.device, batch_size=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=bs)
    if cplan.max_block_id >= nb:
        raise ValueError(f"cplan's block table uses block id {cplan.max_block_id} but k_cache holds {nb} blocks")
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    if use_triton(q):
        if cplan.is_flat:
            decode_triton(q, k_cache, v_cache, cplan.views["block_table"], cplan.views["seq_lens"],
                          cplan.flat_plan, scale, out, lse)
        else:
            cascade_triton(q, k_cache, v_cache, cplan, scale, out, lse)
    else:
        cascade_torch(q, k_cache, v_cache, cplan, scale, out, lse)
    return (out, lse) if return_lse else out
