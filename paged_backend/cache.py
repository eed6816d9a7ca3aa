"""Public KV-cache writes."""
from __future__ import annotations

import torch

from kernels.checks import check_kv_cache, check_shape, check_tensor, debug_enabled
from kernels.dispatch import use_triton
from kernels.write_kv import write_kv_torch, write_kv_triton


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value ``[T, Hkv, D]`` into ``k_cache``/``v_cache`` ``[NB, BS, Hkv, D]`` in place.

    ``slot_mapping [T] int64``: flat slot ``block * BS + row`` per token, ``-1`` = skip. Slots
    past the cache are never written; with ``PAGED_BACKEND_DEBUG=1`` (or CPU tensors) they raise.
    """
    nb, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    check_tensor("key", key, ndim=3, dtypes=(k_cache.dtype,), device=k_cache.device)
    check_tensor("value", value, ndim=3, dtypes=(k_cache.dtype,), device=k_cache.device)
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
    fn = write_kv_triton if use_triton(k_cache) else write_kv_torch
    fn(key, value, k_cache, v_cache, slot_mapping)
