"""Public paged decode."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kernels.checks import check_attention_inputs, check_block_table, check_plan_matches
from kernels.decode import decode_torch, decode_triton
from kernels.dispatch import use_triton
from paged_backend.plan import DecodePlan, plan_decode


@lru_cache(maxsize=32)
def _capacity_plan(batch: int, capacity: int, hq: int, hkv: int, d: int, bs: int, device: torch.device) -> DecodePlan:
    # Without host lengths, plan every request at the table's capacity; the kernel clamps each
    # piece by the device lengths, so the result is exact (only the balance suffers).
    return plan_decode(np.full(batch, capacity), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=bs, device=device)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float | None = None, plan: DecodePlan | None = None,
                 return_lse: bool = True):
    """Attention of one query token per request over its paged K/V.

    q [B, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D] (any strides); block_table [B, max_blocks]
    int32; seq_lens [B] int32 (tokens in cache, the current one included); scale defaults to
    D ** -0.5. Returns ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32, natural log)``, or only
    ``out`` when ``return_lse=False``. A request of length 0 gives out = 0, lse = -inf.

    ``plan`` (from :func:`plan_decode` with the host lengths) balances the work over the GPU and
    lets lengths be checked without reading the device; without one, a plan sized by the table's
    capacity is used (exact, but ragged batches are balanced worse).

    A plan owns the fp32 workspace of the partial states, and so does the capacity plan cached per
    shape when ``plan=None``: calls that share one run one after another on a stream (as the layers
    of a step do); concurrent decodes on different streams need plans of their own.
    """
    nb, bs, hkv, d, hq, scale = check_attention_inputs(q, k_cache, v_cache, scale)
    batch = q.shape[0]
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan from pb.plan_decode, got {type(plan).__name__}")
        check_plan_matches("plan", plan, q.device, batch_size=batch, num_q_heads=hq, num_kv_heads=hkv,
                           head_dim=d, block_size=bs)
    check_block_table(block_table, seq_lens, nb, bs, batch, q.device,
                      seq_lens_host=None if plan is None else plan.seq_lens_host)
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    if use_triton(q):
        if plan is None:
            plan = _capacity_plan(batch, block_table.shape[1] * bs, hq, hkv, d, bs, q.device)
        decode_triton(q, k_cache, v_cache, block_table, seq_lens, plan, scale, out, lse)
    else:
        decode_torch(q, k_cache, v_cache, block_table, seq_lens, scale, out, lse)
    return (out, lse) if return_lse else out
