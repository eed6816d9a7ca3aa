"""Paged prefill on the CPU, in torch (the path ``paged_prefill`` takes for CPU tensors, and the transformers
plug-in's attention on the CPU): work items of a few requests' query rows and keys, attended with ATen's fused CPU
attention in fp32 (soft-capped scores in the open, with einsum)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from paged_backend.kernels.attend import dequantized, sink_states, soft_cap
from paged_backend.kernels.decode_torch import SDPA_CPU, cache_rows_torch


def prefill_torch(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale: float, causal: bool,
                  out, lse, budget: int = 1 << 24, softcap: float = 0.0, sinks=None, window: int = 0,
                  scales=(None, None)):
    """Vectorised torch version (CPU tensors), fp32 math.

    Each request's queries are cut into chunks of at most ``budget / (Hq * padded seq_len)`` rows;
    consecutive chunks are batched (queries and keys padded to the batch's longest) while the
    score tensor stays within ``budget`` elements (:func:`prefill_chunks_torch`); each batch is
    one call of ATen's fused CPU attention (:func:`prefill_chunk_torch`; soft-capping:
    :func:`_prefill_torch_chunk_einsum`).
    """
    hq = q.shape[1]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if softcap > 0:
        for items, qmax, kmax in _work_items(starts, lens, hq, bs, budget):
            _prefill_torch_chunk_einsum(q, k_cache, v_cache, block_table, items, starts, lens, qmax, kmax, scale,
                                        causal, out, lse, hq // hkv, softcap, sinks, window, scales)
        return
    for chunk in prefill_chunks_torch(block_table, starts, lens, hq, hkv, bs, causal, window, budget):
        o, l_ = prefill_chunk_torch(q, k_cache, v_cache, chunk, scale, sinks, scales)
        out[chunk.dst] = o.to(out.dtype)
        lse[chunk.dst] = l_


def _work_items(starts: list, lens: list, hq: int, bs: int, budget: int):
    """Work items (request, first query of the chunk, chunk length, padded key length), batched:
    yields (items, longest chunk, longest padded keys) with the batch's scores within ``budget``."""
    items = []
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if q_len <= 0:
            continue
        kpad = -(-n // bs) * bs
        step = max(1, budget // max(1, hq * kpad))
        for i in range(0, q_len, step):
            items.append((b, i, min(step, q_len - i), kpad))
    lo = 0
    while lo < len(items):
        hi, qmax, kmax = lo, 0, 0
        while hi < len(items):
            nq, nk = max(qmax, items[hi][2]), max(kmax, items[hi][3])
            if hi > lo and (hi - lo + 1) * nq * nk * hq > budget:
                break
            qmax, kmax, hi = nq, nk, hi + 1
        yield items[lo:hi], qmax, kmax
        lo = hi


class PrefillChunk(NamedTuple):
    """One batch of :func:`prefill_chunks_torch`: R work items of ``qmax`` queries and ``kmax`` keys."""
    rows: torch.Tensor          # [R * qmax] int64: the query row of each (item, query); padding reads row 0
    live: torch.Tensor | None   # [R, qmax] bool: the real queries (None: all)
    dst: torch.Tensor           # [N] int64: the rows of the real queries, in (item, query) order
    slots: torch.Tensor         # [R * kmax] int64: the cache's flat slot of each (item, key)
    mask: torch.Tensor          # [R, 1, G * qmax, kmax] fp32: 0 where a query (of each of G heads) sees a key, -inf
    none: torch.Tensor | None   # [R, qmax] bool: real queries that see no key (out 0, lse -inf), or None
    qmax: int
    kmax: int


def prefill_chunks_torch(block_table, starts: list, lens: list, num_q_heads: int, num_kv_heads: int,
                         block_size: int, causal: bool = True, window: int = 0,
                         budget: int = 1 << 24) -> list[PrefillChunk]:
    """Where :func:`prefill_chunk_torch` reads queries and keys and what each query sees, made once for
    any number of layers of one cache layout (host metadata in numpy): block_table [B, M] (CPU
    tensor or numpy), ``starts`` (query_start_loc, B + 1) and ``lens`` (keys per request) as lists.
    A key past its request's length reads the request's key 0 (finite, masked out; slot 0 for an
    empty request): a slot no request owns may hold NaN, and a zero weight times NaN is NaN."""
    table = block_table.numpy() if isinstance(block_table, torch.Tensor) else np.asarray(block_table)
    group, bs = num_q_heads // num_kv_heads, block_size
    at, all_lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    chunks = []
    for items, qmax, kmax in _work_items(starts, lens, num_q_heads, bs, budget):
        r = len(items)
        it = np.asarray(items, dtype=np.int64).reshape(r, 4)
        req, first, count = it[:, 0], it[:, 1], it[:, 2]
        n = all_lens[req]  # keys of each item's request
        q0, q_len = at[req], at[req + 1] - at[req]
        ar_q, keys = np.arange(qmax), np.arange(kmax)
        q_ok = ar_q[None, :] < count[:, None]  # [R, qmax]
        qi = first[:, None] + ar_q[None, :]  # query index within the request
        rows = np.where(q_ok, q0[:, None] + qi, 0)
        ok = np.broadcast_to(keys[None, None, :] < n[:, None, None], (r, qmax, kmax))  # [R, qmax, kmax]
        if causal:
            pos = (n - q_len)[:, None] + qi  # key position of each query  [R, qmax]
            ok = ok & (keys[None, None, :] <= pos[:, :, None])
            if window:
                ok = ok & (keys[None, None, :] > pos[:, :, None] - window)
        kpos = np.minimum(keys[None, :], np.maximum(n - 1, 0)[:, None])  # [R, kmax]
        blk = (np.take_along_axis(table[req].astype(np.int64), kpos // bs, 1) if table.shape[1]
               else np.zeros_like(kpos))
        slots = np.where(n[:, None] > 0, blk * bs + kpos % bs, 0).reshape(-1)
        mask = np.where(ok, np.float32(0), np.float32(-np.inf))[:, None, None]  # [R, 1, 1, qmax, kmax]
        mask = np.repeat(mask, group, axis=2).reshape(r, 1, group * qmax, kmax)  # (a new, writable array)
        none = ~ok.any(-1) & q_ok
        chunks.append(PrefillChunk(torch.from_numpy(rows.reshape(-1)), None if q_ok.all() else torch.from_numpy(q_ok),
                                   torch.from_numpy(rows[q_ok]), torch.from_numpy(slots),
                                   torch.from_numpy(mask),
                                   torch.from_numpy(none) if none.any() else None, qmax, kmax))
    return chunks


def prefill_chunk_torch(q, k_cache, v_cache, chunk: PrefillChunk, scale: float, sinks=None, scales=(None, None),
                        need_lse: bool = True):
    """One batch of :func:`prefill_chunks_torch` with ATen's fused CPU attention in fp32, a work
    item's query heads of one KV head stacked as its queries: q [T, Hq, D], caches [NB, BS, Hkv, D]
    -> (o [N, Hq, D] fp32, lse [N, Hq] fp32 or None with ``need_lse=False``), N = ``len(chunk.dst)``.
    One fused op instead of ~30 small ones (SmolLM2-135M, a 32-token prompt on 2 cores: ~1 ms a
    layer before, ~0.2 ms now, in the engine)."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group, r, qmax, kmax = hq // hkv, chunk.rows.numel() // chunk.qmax, chunk.qmax, chunk.kmax
    k = dequantized(cache_rows_torch(k_cache, chunk.slots), scales[0]).view(r, kmax, hkv, d).transpose(1, 2)
    v = dequantized(cache_rows_torch(v_cache, chunk.slots), scales[1]).view(r, kmax, hkv, d).transpose(1, 2)
    qg = q.index_select(0, chunk.rows).float().view(r, qmax, hkv, group, d).permute(0, 2, 3, 1, 4)
    o, l_ = SDPA_CPU(qg.reshape(r, hkv, group * qmax, d), k, v, attn_mask=chunk.mask, scale=scale)
    o = o.reshape(r, hkv, group, qmax, d).permute(0, 3, 1, 2, 4).reshape(r, qmax, hq, d)
    need_lse = need_lse or sinks is not None
    l_ = l_.reshape(r, hkv, group, qmax).permute(0, 3, 1, 2).reshape(r, qmax, hq) if need_lse else None
    if chunk.none is not None:
        o[chunk.none] = 0.0
        if need_lse:
            l_[chunk.none] = float("-inf")
    if chunk.live is None:
        o, l_ = o.reshape(r * qmax, hq, d), None if l_ is None else l_.reshape(r * qmax, hq)
    else:
        o, l_ = o[chunk.live], None if l_ is None else l_[chunk.live]
    sink_states(o, l_, sinks)
    return o, l_


def _prefill_torch_chunk_einsum(q, k_cache, v_cache, block_table, items, starts, lens, qmax, kmax, scale, causal,
                                out, lse, group, softcap, sinks, window, scales):
    """:func:`prefill_chunk_torch` with the scores in the open (soft-capping)."""
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    req = torch.tensor([it[0] for it in items])
    first = torch.tensor([it[1] for it in items])  # query index within the request
    count = torch.tensor([it[2] for it in items])
    n = torch.tensor([lens[it[0]] for it in items])
    q_len = torch.tensor([starts[it[0] + 1] - starts[it[0]] for it in items])
    q0 = torch.tensor([starts[it[0]] for it in items])
    ar_q = torch.arange(qmax)
    q_ok = ar_q[None, :] < count[:, None]  # [R, qmax]
    qi = first[:, None] + ar_q[None, :]  # query index within the request
    rows = torch.where(q_ok, q0[:, None] + qi, 0)
    qg = q[rows].float().view(len(items), qmax, hkv, group, d)
    n_blk = kmax // bs
    live_blk = torch.arange(n_blk)[None, :] < ((n + bs - 1) // bs)[:, None]
    bt = torch.where(live_blk, block_table[req, :n_blk].long(), 0)  # dead ids are never read
    keys = torch.arange(kmax)
    in_seq = keys[None, :] < n[:, None]  # [R, kmax]
    k = dequantized(k_cache[bt].flatten(1, 2), scales[0])  # [R, kmax, Hkv, D] (a fresh gather)
    v = dequantized(v_cache[bt].flatten(1, 2), scales[1])
    # Slots past a row's length may hold anything (NaN): their scores are masked, and their values
    # zeroed (a zero weight times NaN is NaN).
    v[~in_seq] = 0.0
    s = soft_cap(torch.einsum("rqhgd,rkhd->rhgqk", qg, k) * scale, softcap)
    ok = in_seq[:, None, :]  # [R, 1, kmax]
    if causal:
        pos = (n - q_len)[:, None] + qi  # key position of each query  [R, qmax]
        ok = ok & (keys[None, None, :] <= pos[:, :, None])
        if window:
            ok = ok & (keys[None, None, :] > pos[:, :, None] - window)
    s = s.masked_fill(~ok[:, None, None], float("-inf"))
    l_ = torch.logsumexp(s, dim=-1)  # [R, Hkv, g, qmax]
    p = torch.exp(s - l_.nan_to_num(neginf=0.0)[..., None])  # rows without keys: exp(-inf) = 0
    o = torch.einsum("rhgqk,rkhd->rqhgd", p, v).reshape(len(items), qmax, hq, d)[q_ok]  # [N, Hq, D]
    l_ = l_.permute(0, 3, 1, 2).reshape(len(items), qmax, hq)[q_ok]
    sink_states(o, l_, sinks)
    out[rows[q_ok]] = o.to(out.dtype)
    lse[rows[q_ok]] = l_
