"""Public paged decode."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from paged_backend.kernels.checks import (FLOAT_DTYPES, FP8_DTYPES, HEAD_DIMS, check_kv_scales, check_attention_inputs, check_block_table, check_plan_matches,
                            check_plan_window, check_scale, check_shape, check_sinks, check_softcap, check_tensor,
                            check_window, debug_enabled)
from paged_backend.decode_plan import check_plan_covers
from paged_backend.kernels.decode import decode_triton
from paged_backend.kernels.decode_torch import decode_torch
from paged_backend.kernels.dispatch import use_triton
from paged_backend.decode_plan import DecodePlan, plan_decode


@lru_cache(maxsize=32)
def _capacity_plan(batch: int, capacity: int, hq: int, hkv: int, d: int, bs: int, device: torch.device,
                   window: int, kv_dtype: torch.dtype) -> DecodePlan:
    # Without host lengths, plan every request at the table's capacity; the kernel clamps each
    # piece by the device lengths, so the result is exact (only the balance suffers).
    return plan_decode(np.full(batch, capacity), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=bs, device=device, window=window or None, kv_dtype=kv_dtype)


def _output(name, t, shape, dtype, device):
    """A caller's output tensor, checked, or a new one."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, t, dtypes=(dtype,), device=device)
    check_shape(name, t, shape)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    return t


def _fits_plan(q, k_cache, v_cache, block_table, seq_lens, plan, window: int = 0) -> bool:
    """True only where every check of ``_checked`` on the inputs passes, for the common call (a plan
    from plan_decode) at the cost of some attribute reads (caller outputs: ``_fits_out``); otherwise
    ``_checked`` runs and names what is wrong. The plan's fields are read, not cached: they are
    public and could change."""
    tensor = torch.Tensor
    if type(plan) is not DecodePlan or not (type(q) is tensor and type(k_cache) is tensor
                                            and type(v_cache) is tensor and type(block_table) is tensor
                                            and type(seq_lens) is tensor):
        return False
    b, hq, hkv, d, bs, dev = (plan.batch_size, plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.block_size,
                              plan.device)
    lens, top = plan.host_max
    dtype, k_shape, bt_shape = q.dtype, k_cache.shape, block_table.shape
    kv_dtype = k_cache.dtype
    return (lens is plan.seq_lens_host and dtype in FLOAT_DTYPES and (kv_dtype is dtype or kv_dtype in FP8_DTYPES)
            and v_cache.dtype is kv_dtype and block_table.dtype is torch.int32 and seq_lens.dtype is torch.int32
            and q.shape == (b, hq, d) and k_shape[1:] == (bs, hkv, d) and k_shape[0] > 0
            and v_cache.shape == k_shape and len(bt_shape) == 2 and bt_shape[0] == b and seq_lens.shape == (b,)
            and top <= bt_shape[1] * bs
            and d in HEAD_DIMS and 0 < bs <= 256 and not bs & (bs - 1) and 0 < hkv and 0 < hq and not hq % hkv
            and q.device == dev and k_cache.device == dev and v_cache.device == dev and block_table.device == dev
            and seq_lens.device == dev and dev.type != "cpu" and not debug_enabled()
            and (plan.window or 0) == window)


def _fits_out(t, shape, dtype, device) -> bool:
    """True for no caller output, or one that ``_output`` accepts without a word."""
    return t is None or (type(t) is torch.Tensor and t.dtype is dtype and t.shape == shape and t.device == device
                         and t.is_contiguous())


def _checked(q, k_cache, v_cache, block_table, seq_lens, scale, plan, out, lse_out, window: int = 0):
    """Every input check, each error naming its argument -> ``(scale, out, lse)``."""
    nb, bs, hkv, d, hq, scale = check_attention_inputs(q, k_cache, v_cache, scale)
    batch = q.shape[0]
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan from pb.plan_decode, got {type(plan).__name__}")
        check_plan_matches("plan", plan, q.device, batch_size=batch, num_q_heads=hq, num_kv_heads=hkv,
                           head_dim=d, block_size=bs)
        check_plan_window("plan", plan, window)
    check_block_table(block_table, seq_lens, nb, bs, batch, q.device,
                      seq_lens_host=None if plan is None else plan.seq_lens_host)
    if plan is not None:
        check_plan_covers(plan, seq_lens)
    out = _output("out", out, (batch, hq, d), q.dtype, q.device)
    lse = _output("lse_out", lse_out, (batch, hq), torch.float32, q.device)
    return scale, out, lse


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float | None = None, plan: DecodePlan | None = None,
                 return_lse: bool = True, *, out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None,
                 k_scale=None, v_scale=None):
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

    ``out`` [B, Hq, D] (q's dtype) and ``lse_out`` [B, Hq] float32, contiguous, on q's device: write
    the results there instead of new tensors (e.g. straight into a collective's send buffer, see
    ``TreeMerger.send_views``); ``lse_out`` is written even when ``return_lse=False``.

    ``softcap``: logit soft-capping (Gemma 2): each score ``x = scale * q.k`` becomes
    ``softcap * tanh(x / softcap)`` before the softmax; ``lse`` is of the capped scores. None: none.

    ``sinks [Hq]`` float32 (gpt-oss, vLLM's ``sinks``): per query head, a logit added to the softmax
    denominator as a key of value 0: ``out`` is scaled by ``exp(lse_keys - lse)`` and ``lse =
    logaddexp(lse_keys, sink)`` *includes* the sink (an empty request gives out = 0, lse = sink).
    Merge such states only with states without the sink (it is counted once per state).

    ``window``: sliding-window attention (Mistral, Qwen2, Gemma 2/3, gpt-oss): the query at
    position ``p = seq_len - 1`` attends the keys at ``p - window < pos <= p``, i.e. the last
    ``window`` tokens (vLLM's ``sliding_window``, transformers' ``config.sliding_window``,
    FlashInfer's ``window_left = window - 1``). None: all keys. A ``plan`` must be made with the
    same window (``plan_decode(..., window=window)``); only the window's keys are read.

    fp8 KV cache (``torch.float8_e4m3fn`` / ``float8_e5m2`` caches, written by :func:`write_kv`
    with the same scales): ``k_scale``, ``v_scale`` are the per-tensor dequantization scales (a
    stored value times its scale is the real one), each a positive float or a one-element float32
    tensor on the device (vLLM's ``layer._k_scale``); None means 1.0. q is fp16/bf16 (or fp32); the
    kernels convert the cache's values to q's dtype, accumulate in fp32 and return q's dtype.
    """
    softcap = check_softcap(softcap)
    window = check_window(window)
    if _fits_plan(q, k_cache, v_cache, block_table, seq_lens, plan, window) \
            and _fits_out(out, q.shape, q.dtype, q.device) \
            and _fits_out(lse_out, q.shape[:2], torch.float32, q.device):
        b, hq, d = plan.batch_size, plan.num_q_heads, plan.head_dim
        scale = check_scale(scale, d)
        # (sizes as ints: torch.empty parses a torch.Size argument a microsecond slower)
        out = torch.empty(b, hq, d, dtype=q.dtype, device=plan.device) if out is None else out
        lse = torch.empty(b, hq, dtype=torch.float32, device=plan.device) if lse_out is None else lse_out
    else:
        scale, out, lse = _checked(q, k_cache, v_cache, block_table, seq_lens, scale, plan, out, lse_out, window)
    sinks = check_sinks(sinks, q.shape[1], q.device)
    scales = check_kv_scales(k_cache, k_scale, v_scale)
    if use_triton(q):
        if plan is None:
            b, hq, d = q.shape
            bs, hkv = k_cache.shape[1], k_cache.shape[2]
            plan = _capacity_plan(b, block_table.shape[1] * bs, hq, hkv, d, bs, q.device, window, k_cache.dtype)
        decode_triton(q, k_cache, v_cache, block_table, seq_lens, plan, scale, out, lse, softcap, sinks, scales)
    else:
        decode_torch(q, k_cache, v_cache, block_table, seq_lens, scale, out, lse, softcap, sinks, window, scales)
    return (out, lse) if return_lse else out
