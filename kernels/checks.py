"""Argument checks shared by every launcher.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, device
or value) whose message starts with the argument's name, so a caller can tell which of many
tensors was wrong. Checks that would need a device-to-host copy (block-id ranges, lengths held on
the GPU) run only when ``PAGED_BACKEND_DEBUG=1``.
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # KV caches only: q and outputs stay in a float dtype
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
HEAD_DIMS = (64, 80, 96, 128, 256)


def debug_enabled() -> bool:
    return os.environ.get("PAGED_BACKEND_DEBUG", "0") not in ("", "0")


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """``shape`` may hold ``None`` for dimensions that are free."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def check_kv_cache(k_cache, v_cache, device=None) -> tuple[int, int, int, int]:
    """Returns ``(NB, BS, Hkv, D)`` of a ``[NB, BS, Hkv, D]`` cache pair (any strides)."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=CACHE_DTYPES, device=k_cache.device)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {list(v_cache.shape)} must equal k_cache shape {list(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} must equal k_cache dtype {k_cache.dtype}")
    nb, bs, hkv, d = k_cache.shape
    if nb < 1:
        raise ValueError("k_cache must hold at least one block")
    if bs < 1 or bs > 256 or bs & (bs - 1):
        raise ValueError(f"k_cache block size (dim 1) must be a power of two in 1..256, got {bs}")
    if d not in HEAD_DIMS:
        raise ValueError(f"k_cache head dim (dim 3) must be one of {HEAD_DIMS}, got {d}")
    if hkv < 1:
        raise ValueError("k_cache must have at least one KV head (dim 2)")
    return nb, bs, hkv, d


def check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    """Returns the group size ``Hq // Hkv``."""
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a positive multiple of the cache's KV heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads


def check_softcap(softcap) -> float:
    """``softcap`` None (no capping) or a finite float > 0 -> the float the kernels take (0: none)."""
    return 0.0 if softcap is None else _positive_float("softcap", softcap, " (or None for no capping)")


def check_window(window) -> int:
    """``window`` None (full attention) or an int >= 1: a query at position ``p`` attends the keys
    at positions ``p - window < pos <= p`` (``window`` keys, itself included: vLLM's
    ``sliding_window``, transformers' ``config.sliding_window``, FlashInfer's ``window_left + 1``).
    -> the int the kernels take (0: none)."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
        raise TypeError(f"window must be an int or None, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (keys attended, the query's own included) or None, got {window}")
    return int(window)


def check_plan_window(name: str, plan, window: int) -> None:
    """A plan partitions each request's last ``plan.window`` keys (None: all): it must be made
    for the call's window (``window`` as from :func:`check_window`, 0: none)."""
    if (plan.window or 0) != window:
        raise ValueError(f"{name} was made with window={plan.window} but this call has window={window or None}; "
                         f"make it with the same window (one plan per distinct window of a model's layers)")


def check_sinks(sinks, num_q_heads: int, device) -> torch.Tensor | None:
    """``sinks``: None, or ``[Hq]`` float32 logits on ``device``, one per query head (stride 1).
    Values are not read (no sync); a non-finite sink gives non-finite results."""
    if sinks is None:
        return None
    check_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32,), device=device)
    check_shape("sinks", sinks, (num_q_heads,))
    if num_q_heads > 1 and sinks.stride(0) != 1:
        raise ValueError(f"sinks must be contiguous (stride 1), got stride {sinks.stride(0)}")
    return sinks


@lru_cache(maxsize=64)
def _scale_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A float scale as the ``[1]`` fp32 device tensor the kernels read (one copy per value)."""
    return torch.tensor([value], dtype=torch.float32, device=device)


def check_kv_scales(k_cache, k_scale, v_scale):
    """Dequantization scales of an fp8 cache (a stored value times its scale is the real one), as
    vLLM passes them: each a positive finite float, or a float32 tensor of one element on the
    cache's device (its value is read only when on the host or with ``PAGED_BACKEND_DEBUG=1``);
    None means 1.0. A cache of another dtype takes none. -> ``(k_scale, v_scale)`` as ``[1]``
    float32 tensors on the cache's device, or ``(None, None)`` for a cache that is not fp8."""
    if k_cache.dtype not in FP8_DTYPES:
        for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None:
                raise ValueError(f"{name} is for fp8 caches only (the cache is {k_cache.dtype}); pass None")
        return None, None
    return tuple(_one_scale(name, val, k_cache.device) for name, val in (("k_scale", k_scale), ("v_scale", v_scale)))


def _one_scale(name: str, val, device) -> torch.Tensor:
    if val is None:
        return _scale_tensor(1.0, device)
    if isinstance(val, torch.Tensor):
        check_tensor(name, val, dtypes=(torch.float32,), device=device)
        if val.numel() != 1:
            raise ValueError(f"{name} must hold one element (a per-tensor scale), got shape {list(val.shape)}")
        if val.device.type == "cpu" or debug_enabled():
            _positive_float(name, float(val.reshape(-1)[0]))
        return val.reshape(1)
    return _scale_tensor(_positive_float(name, val), device)


def check_scale(scale, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else _positive_float("scale", scale)


def _positive_float(name: str, val, alternative: str = "") -> float:
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(val).__name__}")
    val = float(val)
    if not (val > 0.0 and val < float("inf")):
        raise ValueError(f"{name} must be positive and finite{alternative}, got {val}")
    return val


def check_block_table(block_table, seq_lens, num_blocks: int, block_size: int, batch: int,
                      device, seq_lens_host=None) -> None:
    """``block_table [B, max_blocks] int32`` and ``seq_lens [B] int32``.

    Lengths are checked against the table's capacity when they are on the host (CPU tensors, or
    ``seq_lens_host`` from a plan); block ids only in debug mode, since that reads the table.
    """
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have {batch} rows (one per request), got {block_table.shape[0]}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have {batch} entries (one per request), got {seq_lens.shape[0]}")
    capacity = block_table.shape[1] * block_size
    host = seq_lens_host
    if host is None and (seq_lens.device.type == "cpu" or debug_enabled()):
        host = seq_lens.cpu()
    if host is not None:
        # numpy: a plan's host lengths are numpy already, and this runs once per layer
        host = host.cpu().numpy() if isinstance(host, torch.Tensor) else np.asarray(host)
        lo, hi = (int(host.min()), int(host.max())) if host.size else (0, 0)
        if lo < 0:
            raise ValueError(f"seq_lens must be >= 0, got min {lo}")
        if hi > capacity:
            raise ValueError(
                f"seq_lens max {hi} exceeds the block table's capacity "
                f"{block_table.shape[1]} blocks x {block_size} = {capacity}")
    if debug_enabled() and host is not None and host.size:
        used = (torch.from_numpy(host.astype(np.int64)) + block_size - 1) // block_size  # (a plan's is read-only)
        cols = torch.arange(block_table.shape[1])
        live = cols[None, :] < used[:, None]
        ids = block_table.cpu()[live]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(
                f"block_table holds block ids outside [0, {num_blocks}) in its used entries "
                f"(min {int(ids.min())}, max {int(ids.max())})")


def check_attention_inputs(q, k_cache, v_cache, scale):
    """q [*, Hq, D] against a ``[NB, BS, Hkv, D]`` cache pair -> ``(NB, BS, Hkv, D, Hq, scale)``.
    An fp8 cache takes queries of any float dtype; any other cache, queries of its own dtype."""
    nb, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=k_cache.device)
    if q.dtype != k_cache.dtype and k_cache.dtype not in FP8_DTYPES:
        raise TypeError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    check_shape("q", q, (None, None, d))
    hq = q.shape[1]
    check_heads(hq, hkv)
    return nb, bs, hkv, d, hq, check_scale(scale, d)


def check_plan_matches(name: str, plan, device, **want) -> None:
    """Each ``plan.<key>`` must equal ``want[key]`` and the plan must live on ``device``."""
    for key, val in want.items():
        if getattr(plan, key) != val:
            raise ValueError(f"{name}.{key} is {getattr(plan, key)} but the inputs have {val}")
    if plan.device != device:
        raise ValueError(f"{name} is on {plan.device} but the inputs are on {device}")
