"""Writing new K/V into the paged cache (vLLM's reshape_and_cache).

``slot_mapping[t]`` is the flat slot ``block * BS + row`` of token ``t``; ``-1`` skips the token
(padding). The cache may have any strides (vLLM's ``[NB, Hkv, BS, 2D]`` buffer viewed as K and V).
An fp8 cache stores ``x / scale`` saturated to the format's largest finite value (a cast alone
would turn an out-of-range value into NaN for e4m3fn).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ks_ptr, vs_ptr, stride_slot,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    H, num_slots, BS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # One program per token: all its KV heads at once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t * stride_slot)
    # -1 marks padding; an id past the cache is skipped too, so a bad mapping never writes
    # outside the cache (PAGED_BACKEND_DEBUG=1 reports it instead).
    if (slot < 0) | (slot >= num_slots):
        return
    blk = slot // BS
    row = slot % BS
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + row * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    vc = v_cache_ptr + blk * stride_vcb + row * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    if QUANT:  # fp8: x / scale, saturated (scales are [1] fp32, read once per token)
        k = tl.clamp(k.to(tl.float32) / tl.load(ks_ptr), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(vs_ptr), -FP8_MAX, FP8_MAX)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format (e4m3fn 448, e5m2 57344)."""
    return float(torch.finfo(dtype).max)


def write_kv_triton(key, value, k_cache, v_cache, slot_mapping, scales=(None, None)):
    """key, value [T, Hkv, D]; caches [NB, BS, Hkv, D]; slot_mapping [T] int64; ``scales``: an fp8
    cache's ``(k_scale, v_scale)`` ``[1]`` fp32 tensors, or ``(None, None)``."""
    t, h, d = key.shape
    if t == 0:
        return
    quant = scales[0] is not None
    _write_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping, *(slot_mapping if s is None else s for s in scales),
        slot_mapping.stride(0), *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        h, k_cache.shape[0] * k_cache.shape[1], BS=k_cache.shape[1], D=d,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
        QUANT=quant, FP8_MAX=fp8_max(k_cache.dtype) if quant else 0.0,
    )


def write_kv_torch(key, value, k_cache, v_cache, slot_mapping, scales=(None, None)):
    """Vectorised torch version of :func:`write_kv_triton` (CPU tensors)."""
    keep = (slot_mapping >= 0) & (slot_mapping < k_cache.shape[0] * k_cache.shape[1])
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    blk, row = slots // bs, slots % bs
    for cache, x, scale in ((k_cache, key, scales[0]), (v_cache, value, scales[1])):
        x = x[keep]
        if scale is not None:
            top = fp8_max(cache.dtype)
            x = (x.float() / scale.to(x.device)).clamp(-top, top)
        cache[blk, row] = x.to(cache.dtype)
