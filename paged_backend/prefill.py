"""Public paged prefill (varlen, chunked, mixed with decodes)."""
from __future__ import annotations

import torch

from paged_backend.kernels.checks import (check_attention_inputs, check_block_table, check_sinks, check_softcap,
                                         check_kv_scales, check_tensor, check_window, debug_enabled)
from paged_backend.kernels.dispatch import use_sm90, use_triton
from paged_backend.kernels.prefill import prefill_triton
from paged_backend.kernels.prefill_torch import prefill_torch


def check_query_start_loc(query_start_loc, num_tokens: int, batch: int, device, query_start_loc_host=None,
                          seq_lens_host=None) -> None:
    """``query_start_loc [B+1] int32``: 0, monotone non-decreasing, ending at ``T``; each
    ``q_len_b <= seq_len_b``.

    Values are checked when they are on the host (CPU tensors, or the host copies given), or in
    debug mode (which reads the device tensors); shapes and dtypes always.
    """
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc must have B+1 = {batch + 1} entries (B from seq_lens), "
                         f"got {query_start_loc.shape[0]}")
    host = query_start_loc_host
    if host is not None:
        if not isinstance(host, torch.Tensor):
            host = torch.as_tensor(host)
        if host.dim() != 1 or host.shape[0] != batch + 1:
            raise ValueError(f"query_start_loc_cpu must have B+1 = {batch + 1} entries, got shape {list(host.shape)}")
    elif query_start_loc.device.type == "cpu" or debug_enabled():
        host = query_start_loc.cpu()
    if host is None:
        return
    host = host.to(torch.int64)
    if int(host[0]) != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(host[0])}")
    q_lens = host[1:] - host[:-1]
    if q_lens.numel() and int(q_lens.min()) < 0:
        b = int(torch.nonzero(q_lens < 0)[0])
        raise ValueError(f"query_start_loc must be monotone non-decreasing, but entry {b + 1} ({int(host[b + 1])}) "
                         f"< entry {b} ({int(host[b])})")
    if int(host[-1]) != num_tokens:
        raise ValueError(f"query_start_loc must end at T = {num_tokens} (q's tokens), got {int(host[-1])}")
    if seq_lens_host is not None and q_lens.numel():
        over = q_lens > torch.as_tensor(seq_lens_host).to(torch.int64)
        if over.any():
            b = int(torch.nonzero(over)[0])
            raise ValueError(f"query_start_loc gives request {b} q_len {int(q_lens[b])} > seq_lens[{b}] = "
                             f"{int(torch.as_tensor(seq_lens_host)[b])} (queries are the last q_len cached tokens)")


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, causal: bool = True,
                  return_lse: bool = True, *, scale: float | None = None, query_start_loc_cpu=None,
                  seq_lens_cpu=None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                  window: int | None = None, k_scale=None, v_scale=None):
    """Varlen attention of new query tokens over their requests' paged K/V.

    q [T, Hq, D]: request ``b``'s queries are rows ``query_start_loc[b]:query_start_loc[b+1]``, its
    *last* ``q_len_b`` tokens (their K/V already written with :func:`write_kv`); its keys are all
    ``seq_lens[b]`` cached tokens. ``causal=True`` lets query ``i`` see keys up to its own position
    ``seq_len_b - q_len_b + i`` (bottom-right aligned, so a chunk continues a cached prefix and a
    q_len of 1 is a decode). k_cache, v_cache [NB, BS, Hkv, D] (any strides); block_table
    [B, max_blocks] int32; seq_lens [B] int32; query_start_loc [B+1] int32 (0, non-decreasing, T).
    Requests with q_len 0 are allowed. scale defaults to D ** -0.5.

    Returns ``(out [T, Hq, D] in q's dtype, lse [T, Hq] float32, natural log)`` - a state that
    merges with decode/cascade states - or ``out`` when ``return_lse=False``.

    ``query_start_loc_cpu`` / ``seq_lens_cpu``: optional host copies of the metadata (as a plan
    keeps them). They are only used to validate values without reading the GPU (the kernel itself
    never needs them); without them GPU values are checked only with ``PAGED_BACKEND_DEBUG=1``.
    ``softcap``, ``sinks``: logit soft-capping and attention sinks, as in :func:`paged_decode`.
    ``window`` (causal only): sliding window, as in :func:`paged_decode`: the query at position
    ``p`` attends the keys at ``p - window < pos <= p``; key tiles outside every query's window are
    skipped, so a long chunk costs ``q_len x window``, not ``q_len x seq_len``. ``k_scale``,
    ``v_scale``: an fp8 cache's dequantization scales, as in :func:`paged_decode`.
    """
    softcap = check_softcap(softcap)
    window = check_window(window)
    nb, bs, hkv, d, hq, scale = check_attention_inputs(q, k_cache, v_cache, scale)
    num_tokens = q.shape[0]
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window and not causal:
        raise ValueError("window needs causal=True (a sliding window bounds a causal query's keys from below)")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device)
    batch = seq_lens.shape[0]
    if seq_lens_cpu is not None:
        seq_lens_cpu = torch.as_tensor(seq_lens_cpu)
        if seq_lens_cpu.dim() != 1 or seq_lens_cpu.shape[0] != batch:
            raise ValueError(f"seq_lens_cpu must have B = {batch} entries, got shape {list(seq_lens_cpu.shape)}")
    check_block_table(block_table, seq_lens, nb, bs, batch, q.device, seq_lens_host=seq_lens_cpu)
    lens_host = seq_lens_cpu
    if lens_host is None and (seq_lens.device.type == "cpu" or debug_enabled()):
        lens_host = seq_lens.cpu()
    check_query_start_loc(query_start_loc, num_tokens, batch, q.device, query_start_loc_cpu, lens_host)
    sinks = check_sinks(sinks, hq, q.device)
    scales = check_kv_scales(k_cache, k_scale, v_scale)
    out = torch.empty(num_tokens, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, hq, dtype=torch.float32, device=q.device)
    if num_tokens:
        sm90 = sm90_config(q, k_cache, v_cache, softcap, window, scales)
        if sm90 is not None:
            from paged_backend.kernels.prefill_sm90 import prefill_sm90
            prefill_sm90(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, out, lse, sm90,
                         sinks=sinks)
        elif use_triton(q):
            prefill_triton(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, out, lse,
                           softcap=softcap, sinks=sinks, window=window, scales=scales)
        else:
            prefill_torch(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, out, lse,
                          softcap=softcap, sinks=sinks, window=window, scales=scales)
    return (out, lse) if return_lse else out


def sm90_config(q, k_cache, v_cache, softcap: float, window: int, scales):
    """The Hopper prefill kernel's settings for a call it covers, or None (the portable kernel runs)."""
    if not use_sm90(q.device):
        return None
    from paged_backend.kernels.prefill_sm90 import sm90_config as config
    return config(q, k_cache, v_cache, softcap, window, scales)


def prefill_kernel_name(q, k_cache, v_cache, softcap: float = 0.0, window: int = 0, scales=(None, None)) -> str:
    """Which kernel :func:`paged_prefill` runs for these inputs: ``"sm90"`` (Gluon, Hopper),
    ``"portable"`` (Triton) or ``"torch"`` (CPU without the interpreter). Benchmarks print it."""
    if sm90_config(q, k_cache, v_cache, softcap, window, scales) is not None:
        return "sm90"
    return "portable" if use_triton(q) else "torch"
