"""Copying whole cache blocks (vLLM's copy_blocks): copy-on-write after a fork.

``block_copies [K, 2] int64`` holds ``(src, dst)`` block ids; block ``src`` is copied to block
``dst`` in every layer's K and V cache. The caches may have any strides (vLLM's
``[NB, Hkv, BS, 2D]`` buffer viewed as K and V). The public wrapper (``paged_backend.cache``)
validates; the kernels here only skip pairs they must not touch (ids outside ``[0, NB)``, and
``src == dst``), so a bad pair never writes outside the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_CHUNK = 4096  # elements per load/store in one loop iteration of a program


@triton.jit
def _copy_blocks_kernel(
    k_ptrs, v_ptrs, k_base, v_base, copies_ptr,
    stride_c0, stride_c1,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    num_blocks, H: tl.constexpr, D: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
):
    # One program per (copy, layer): the BS * H * D elements of block src -> block dst, in K and V.
    # k_ptrs / v_ptrs [L] int64 hold each layer's data_ptr(); all layers of one launch share
    # strides and dtype (k_base / v_base give the element type).
    c = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    src = tl.load(copies_ptr + c * stride_c0)
    dst = tl.load(copies_ptr + c * stride_c0 + stride_c1)
    # Out-of-range ids are skipped so memory is never corrupted (PAGED_BACKEND_DEBUG=1 reports
    # them); src == dst is a no-op.
    if (src < 0) | (src >= num_blocks) | (dst < 0) | (dst >= num_blocks) | (src == dst):
        return
    kp = tl.load(k_ptrs + layer).to(tl.pointer_type(k_base.dtype.element_ty))
    vp = tl.load(v_ptrs + layer).to(tl.pointer_type(v_base.dtype.element_ty))
    k_src = kp + src * stride_kb
    k_dst = kp + dst * stride_kb
    v_src = vp + src * stride_vb
    v_dst = vp + dst * stride_vb
    for start in range(0, N, CHUNK):
        e = start + tl.arange(0, CHUNK)
        mask = e < N
        s = e // (H * D)
        r = e % (H * D)
        h = r // D
        d = r % D
        ko = s * stride_ks + h * stride_kh + d * stride_kd
        vo = s * stride_vs + h * stride_vh + d * stride_vd
        tl.store(k_dst + ko, tl.load(k_src + ko, mask=mask), mask=mask)
        tl.store(v_dst + vo, tl.load(v_src + vo, mask=mask), mask=mask)


def copy_blocks_triton(k_caches, v_caches, block_copies):
    """k_caches, v_caches: lists of [NB, BS, Hkv, D] (same shape/dtype/device); block_copies
    [K, 2] int64 on their device. One launch per group of layers sharing strides (usually one)."""
    k_num = block_copies.shape[0]
    if k_num == 0 or not k_caches:
        return
    nb, bs, h, d = k_caches[0].shape
    n = bs * h * d
    chunk = min(triton.next_power_of_2(n), _MAX_CHUNK)
    device = k_caches[0].device
    groups: dict[tuple, list[int]] = {}
    for i, (k, v) in enumerate(zip(k_caches, v_caches)):
        groups.setdefault((k.stride(), v.stride()), []).append(i)
    for (ks, vs), layers in groups.items():
        k_ptrs = torch.tensor([k_caches[i].data_ptr() for i in layers], dtype=torch.int64, device=device)
        v_ptrs = torch.tensor([v_caches[i].data_ptr() for i in layers], dtype=torch.int64, device=device)
        _copy_blocks_kernel[(k_num, len(layers))](
            k_ptrs, v_ptrs, k_caches[layers[0]], v_caches[layers[0]], block_copies,
            *block_copies.stride(), *ks, *vs,
            nb, H=h, D=d, N=n, CHUNK=chunk,
        )


def copy_blocks_torch(k_caches, v_caches, block_copies):
    """Vectorised torch version of :func:`copy_blocks_triton` (CPU tensors): one index copy per
    cache. Skips the same pairs as the kernel."""
    if block_copies.shape[0] == 0 or not k_caches:
        return
    nb = k_caches[0].shape[0]
    src, dst = block_copies[:, 0], block_copies[:, 1]
    keep = (src >= 0) & (src < nb) & (dst >= 0) & (dst < nb) & (src != dst)
    src, dst = src[keep], dst[keep]
    if src.numel() == 0:
        return
    for cache in (*k_caches, *v_caches):
        if cache.element_size() == 1:  # fp8: torch's CPU index_copy_ has no fp8 kernels; the bytes are the same
            cache = cache.view(torch.uint8)
        cache.index_copy_(0, dst, cache.index_select(0, src))
