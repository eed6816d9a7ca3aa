"""Paged decode on the CPU, in torch (the path ``paged_decode`` takes for CPU tensors, and the transformers
plug-in's attention on the CPU): each row's live keys gathered a few requests at a time and attended with ATen's
fused CPU attention in fp32 (soft-capped scores in the open, with einsum)."""
from __future__ import annotations

import numpy as np
import torch

from paged_backend.kernels.attend import dequantized, sink_states, soft_cap


def decode_torch(q, k_cache, v_cache, block_table, seq_lens, scale: float, out, lse, softcap: float = 0.0,
                 sinks=None, window: int = 0, scales=(None, None)):
    """Vectorised torch version (CPU tensors): gathers each row's live keys (the last ``window`` with
    ``window`` > 0) a few requests at a time (:func:`decode_chunks_torch`) and attends with ATen's
    fused CPU attention in fp32 (:func:`decode_chunk_torch`). ``scales``: an fp8 cache's
    ``(k_scale, v_scale)``. Soft-capping takes :func:`_decode_torch_einsum`.

    One fused op instead of ~25 small ones a layer: on 2 cores (SmolLM2-135M, 48 keys) 26 us instead
    of 107, and 71 us instead of 496 with ``OMP_WAIT_POLICY=PASSIVE``, where each of the small ops'
    parallel regions (MKL's exp, bmm) woke the sleeping OpenMP thread."""
    if softcap > 0:
        return _decode_torch_einsum(q, k_cache, v_cache, block_table, seq_lens, scale, out, lse, softcap, sinks,
                                    window, scales)
    chunks = decode_chunks_torch(block_table, seq_lens, k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3], window)
    if not chunks:  # no row has a key
        out.zero_()
        lse.fill_(float("-inf"))
        sink_states(out, lse, sinks)
        return
    for c, n, keys, mask, empty in chunks:
        o, l_ = decode_chunk_torch(q[c:c + n], cache_rows_torch(k_cache, keys), cache_rows_torch(v_cache, keys), n,
                                   scale, mask, empty, sinks, scales)
        out[c:c + n] = o
        lse[c:c + n] = l_


def decode_chunks_torch(block_table, seq_lens, block_size: int, row_elems: int, window: int = 0) -> list[tuple]:
    """Where :func:`decode_chunk_torch` reads each row's keys, made once for any number of layers of
    one cache layout: block_table [B, M] and seq_lens [B] (CPU tensors or numpy arrays; worked on
    in numpy: a few microseconds), ``row_elems`` = Hkv * D.
    -> ``[(first row, rows n, keys, mask, empty)]``, rows in chunks of at most 2^24 gathered
    values; [] when no row has a key. ``keys``: ``(first, L)`` (one row whose blocks follow each
    other: its keys are the cache's flat slots ``first .. first + L``, read in place) or the flat
    slots ``[n * L]`` int64 tensor; ``mask`` [n, 1, 1, L] fp32 tensor (-inf past a row's keys) or
    None when every row has L keys; ``empty`` [n] bool tensor (rows without keys) or None."""
    table = block_table.numpy() if isinstance(block_table, torch.Tensor) else np.asarray(block_table)
    lens = (seq_lens.numpy() if isinstance(seq_lens, torch.Tensor) else np.asarray(seq_lens)).astype(np.int64)
    b = lens.size
    start = np.maximum(lens - window, 0) if window else np.zeros_like(lens)
    count = lens - start  # live keys of each row
    top = int(count.max()) if b else 0
    if top == 0:
        return []
    ragged = bool((count != top).any())
    per = max(1, (1 << 24) // (top * row_elems))  # requests per chunk: bounds memory
    j = np.arange(top)
    chunks = []
    for c in range(0, b, per):
        n, st, cnt = min(per, b - c), start[c:c + per], count[c:c + per]
        if n == 1 and cnt[0] == top:  # one row: are its blocks consecutive?
            first_blk, last_blk = st[0] // block_size, (st[0] + top - 1) // block_size
            run = table[c, first_blk:last_blk + 1].astype(np.int64)
            if (run[1:] - run[:-1] == 1).all():
                chunks.append((c, 1, (int(run[0]) * block_size + int(st[0]) % block_size, top), None, None))
                continue
        # a padding column reads the row's first live key (finite, and masked); an empty row reads slot 0
        pos = st[:, None] + np.minimum(j[None, :], np.maximum(cnt - 1, 0)[:, None])  # [n, L] token positions
        has = cnt[:, None] > 0
        blk = np.take_along_axis(table[c:c + n].astype(np.int64), np.where(has, pos // block_size, 0), 1)
        keys = torch.from_numpy(np.where(has, blk * block_size + pos % block_size, 0).reshape(-1))
        mask = empty = None
        if ragged:
            dead = j[None, :] >= cnt[:, None]
            mask = torch.from_numpy(np.where(dead, np.float32(-np.inf), np.float32(0))).view(n, 1, 1, top)
            if (cnt == 0).any():
                empty = torch.from_numpy(cnt == 0)
        chunks.append((c, n, keys, mask, empty))
    return chunks


def decode_chunk_torch(q, k, v, n: int, scale: float, mask=None, empty=None, sinks=None, scales=(None, None),
                       need_lse: bool = True):
    """Attention of one chunk of :func:`decode_chunks_torch` in fp32 with ATen's fused CPU attention:
    q [n, Hq, D] (its rows); k, v [n * L, Hkv, D] (each row's L keys in turn, as
    ``cache_rows_torch`` reads them); the chunk's ``mask`` and ``empty`` -> (o [n, Hq, D] fp32,
    lse [n, Hq] fp32, or None with ``need_lse=False``)."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    if k.dtype is not torch.float32 or scales[0] is not None:
        k, v = dequantized(k, scales[0]), dequantized(v, scales[1])
    k = k.view(n, -1, hkv, d).transpose(1, 2)  # [n, Hkv, L, D]
    v = v.view(n, -1, hkv, d).transpose(1, 2)
    if q.dtype is not torch.float32:
        q = q.float()
    if q.stride(-1) != 1:  # (the op reads D densely)
        q = q.contiguous()
    # a row's Hq // Hkv query heads are the queries of its KV head
    o, l_ = SDPA_CPU(q.view(n, hkv, hq // hkv, d), k, v, attn_mask=mask, scale=scale)
    o = o.reshape(n, hq, d)
    if not need_lse and empty is None and sinks is None:
        return o, None
    l_ = l_.reshape(n, hq)
    if empty is not None:
        o.masked_fill_(empty[:, None, None], 0.0)
        l_.masked_fill_(empty[:, None], float("-inf"))
    sink_states(o, l_, sinks)
    return o, l_


SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def cache_rows_torch(cache: torch.Tensor, keys) -> torch.Tensor:
    """``cache [NB, BS, H, D]`` at flat slots -> ``[N, H, D]``: ``keys`` a tensor of slots [N]
    (whole rows copied at once where the cache is contiguous: ``cache[blk, row]`` copies value by
    value), or ``(first, N)``: slots first .. first + N (a view where the cache is contiguous)."""
    if isinstance(keys, tuple):
        first, num = keys
        if cache.is_contiguous():
            return cache.view(-1, *cache.shape[2:])[first:first + num]
        keys = torch.arange(first, first + num)
    if cache.is_contiguous():
        return cache.view(-1, *cache.shape[2:]).index_select(0, keys)
    bs = cache.shape[1]
    return cache[keys // bs, keys % bs]


def _decode_torch_einsum(q, k_cache, v_cache, block_table, seq_lens, scale: float, out, lse, softcap: float = 0.0,
                         sinks=None, window: int = 0, scales=(None, None)):
    """:func:`decode_torch` with the scores in the open (soft-capping): gathers whole pages a few
    requests at a time and masks what is not live."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    lens = seq_lens.long()
    max_len = int(lens.max()) if b else 0
    n_blk = -(-max_len // bs)
    per = max(1, (1 << 24) // max(1, n_blk * bs * hkv * d))  # requests per chunk: bounds memory
    for c in range(0, b, per):
        ln = lens[c:c + per]
        live_blk = torch.arange(n_blk)[None, :] < ((ln + bs - 1) // bs)[:, None]
        bt = torch.where(live_blk, block_table[c:c + per, :n_blk].long(), 0)  # dead ids never read
        live = torch.arange(n_blk * bs)[None, :] < ln[:, None]  # [b, L]
        if window:
            live &= torch.arange(n_blk * bs)[None, :] >= (ln - window)[:, None]
        k = dequantized(k_cache[bt].flatten(1, 2), scales[0])  # [b, L, Hkv, D] (a fresh gather)
        v = dequantized(v_cache[bt].flatten(1, 2), scales[1])
        # Slots past a row's length may hold anything (NaN from a reused block): their scores are
        # masked below, but a zero weight times a NaN value is NaN, so those values are zeroed.
        v[~live] = 0.0
        qg = q[c:c + per].float().view(-1, hkv, group, d)
        s = soft_cap(torch.einsum("bhgd,blhd->bhgl", qg, k) * scale, softcap)
        s = s.masked_fill(~live[:, None, None, :], float("-inf"))
        l_ = torch.logsumexp(s, dim=-1)  # [b, Hkv, g]
        p = torch.exp(s - l_.nan_to_num(neginf=0.0)[..., None])  # empty rows: exp(-inf) = 0
        o, l_ = torch.einsum("bhgl,blhd->bhgd", p, v).reshape(-1, hq, d), l_.reshape(-1, hq)
        sink_states(o, l_, sinks)
        out[c:c + per] = o.to(out.dtype)
        lse[c:c + per] = l_
