"""Public KV-cache writes."""
from __future__ import annotations

import numpy as np
import torch

from paged_backend.kernels.checks import (CACHE_DTYPES, FLOAT_DTYPES, FP8_DTYPES, check_kv_cache, check_kv_scales,
                                         check_shape, check_tensor, debug_enabled)
from paged_backend.kernels.copy_blocks import copy_blocks_torch, copy_blocks_triton
from paged_backend.kernels.dispatch import use_triton
from paged_backend.kernels.write_kv import write_kv_torch, write_kv_triton


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale=None, v_scale=None) -> None:
    """Write key/value ``[T, Hkv, D]`` into ``k_cache``/``v_cache`` ``[NB, BS, Hkv, D]`` in place.

    ``slot_mapping [T] int64``: flat slot ``block * BS + row`` per token, ``-1`` = skip. Slots
    past the cache are never written; with ``PAGED_BACKEND_DEBUG=1`` (or CPU tensors) they raise.

    An fp8 cache (``float8_e4m3fn`` / ``float8_e5m2``) takes key/value of any float dtype and stores
    ``value / scale``, saturated to the format's finite range (vLLM's ``reshape_and_cache`` with
    per-tensor scales); ``k_scale``/``v_scale`` as in :func:`paged_decode` (None: 1.0).
    """
    nb, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    kv_dtypes = FLOAT_DTYPES if k_cache.dtype in FP8_DTYPES else (k_cache.dtype,)
    check_tensor("key", key, ndim=3, dtypes=kv_dtypes, device=k_cache.device)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=k_cache.device)
    check_shape("key", key, (None, hkv, d))
    check_shape("value", value, tuple(key.shape))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), device=k_cache.device)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    if slot_mapping.device.type == "cpu" or debug_enabled():
        s = slot_mapping.cpu()
        bad = (s < -1) | (s >= nb * bs)
        if bad.any():
            raise ValueError(f"slot_mapping holds {int(bad.sum())} slots outside [-1, {nb * bs}) "
                             f"(first bad value {int(s[bad][0])})")
    scales = check_kv_scales(k_cache, k_scale, v_scale)
    fn = write_kv_triton if use_triton(key) else write_kv_torch
    fn(key, value, k_cache, v_cache, slot_mapping, scales)


def _cache_list(name: str, caches) -> list:
    if isinstance(caches, torch.Tensor):
        return [caches]
    if isinstance(caches, (list, tuple)):
        return list(caches)
    raise TypeError(f"{name} must be a torch.Tensor or a list/tuple of them, got {type(caches).__name__}")


def copy_blocks(k_caches, v_caches, block_copies) -> None:
    """Copy block ``src`` to block ``dst`` for every ``(src, dst)`` row of ``block_copies``, in
    every given cache, in place (copy-on-write after a fork; vLLM's ``copy_blocks``).

    ``k_caches`` / ``v_caches``: one ``[NB, BS, Hkv, D]`` tensor or a list/tuple of them (one per
    layer; any strides), all of one shape, dtype and device. ``block_copies``: ``[K, 2]`` int64
    tensor on the caches' device, or a CPU tensor / numpy array (moved there; e.g. the
    scheduler's ``ScheduledBatch.block_copies``).

    Rules: ids in ``[0, NB)``; each ``dst`` at most once; ``src == dst`` is a no-op; no chains - a
    block that is the ``dst`` of a copy cannot be the ``src`` of another (pairs with
    ``src == dst`` aside), so the copies are independent and their order does not matter. Checked
    (``ValueError``) when the ids are on the host (numpy, CPU tensor) or with
    ``PAGED_BACKEND_DEBUG=1``; otherwise the kernel still never touches a pair with an id outside
    ``[0, NB)``, and a duplicate ``dst`` or a chain leaves those blocks unspecified.
    """
    ks = _cache_list("k_caches", k_caches)
    vs = _cache_list("v_caches", v_caches)
    if not ks:
        raise ValueError("k_caches must hold at least one cache")
    if len(vs) != len(ks):
        raise ValueError(f"v_caches must hold as many caches as k_caches ({len(ks)}), got {len(vs)}")
    k0 = ks[0]
    check_tensor("k_caches[0]", k0, ndim=4, dtypes=CACHE_DTYPES)
    for name, group in (("k_caches", ks), ("v_caches", vs)):
        for i, c in enumerate(group):
            nm = f"{name}[{i}]"
            check_tensor(nm, c, ndim=4, dtypes=CACHE_DTYPES, device=k0.device)
            if c.shape != k0.shape:
                raise ValueError(f"{nm} shape {list(c.shape)} must equal k_caches[0] shape {list(k0.shape)}")
            if c.dtype != k0.dtype:
                raise TypeError(f"{nm} dtype {c.dtype} must equal k_caches[0] dtype {k0.dtype}")
    nb = k0.shape[0]
    device = k0.device

    if isinstance(block_copies, np.ndarray):
        if block_copies.dtype != np.int64:
            raise TypeError(f"block_copies must have dtype int64, got {block_copies.dtype}")
        block_copies = torch.from_numpy(np.array(block_copies, copy=True))  # contiguous, writable
    check_tensor("block_copies", block_copies, ndim=2, dtypes=(torch.int64,))
    check_shape("block_copies", block_copies, (None, 2))
    on_host = block_copies.device.type == "cpu"
    if not on_host and block_copies.device != device:
        raise ValueError(f"block_copies must be on {device} like the caches (or on the CPU), "
                         f"got {block_copies.device}")
    if block_copies.shape[0] == 0:
        return
    if on_host or debug_enabled():
        _check_block_copies(block_copies.cpu(), nb)
    if block_copies.device != device:
        block_copies = block_copies.to(device)
    fn = copy_blocks_triton if use_triton(k0) else copy_blocks_torch
    fn(ks, vs, block_copies)


def _check_block_copies(c: torch.Tensor, nb: int) -> None:
    bad = (c < 0) | (c >= nb)
    if bad.any():
        raise ValueError(f"block_copies holds {int(bad.sum())} block ids outside [0, {nb}) "
                         f"(first bad value {int(c[bad][0])})")
    src, dst = c[:, 0], c[:, 1]
    uniq, counts = torch.unique(dst, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"block_copies has dst block {int(uniq[counts > 1][0])} more than once")
    moved = src != dst
    chained = torch.isin(src[moved], dst[moved])
    if chained.any():
        raise ValueError(f"block_copies block {int(src[moved][chained][0])} is both the dst of one copy "
                         f"and the src of another (chains are not allowed)")
