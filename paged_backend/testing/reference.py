"""Independent dense references in float64: gather each request's pages into dense K/V and do
plain softmax attention. Only torch; never calls code of the package, so it can judge it.

States are ``(o, lse)``: ``o`` float64, ``lse`` float64 **natural log** of the sum of
``exp(score)`` over the keys attended (scores after soft-capping; with sinks, the sink's logit is
in the sum too). A row with no keys gives ``o = 0``, ``lse = -inf`` (with sinks: ``lse = sink``).
fp8 caches: pass the dequantized caches (:func:`dequantize`).
"""
from __future__ import annotations

import torch


def dequantize(cache: torch.Tensor, scale=None) -> torch.Tensor:
    """An fp8 cache ``[NB, BS, Hkv, D]`` and its per-tensor scale (float, one-element tensor or
    None = 1.0) -> the real values in float32 (stored value times scale). Other dtypes: as is."""
    if cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache
    return cache.float() * (1.0 if scale is None else float(scale))


def gather_kv(k_cache, v_cache, block_table, seq_len: int, b: int):
    """Dense ``[seq_len, Hkv, D]`` K and V of request ``b``, token by token (on the CPU)."""
    bs = k_cache.shape[1]
    pos = torch.arange(seq_len)
    pages = block_table[b].long().cpu()[pos // bs]
    rows = pos % bs
    return k_cache.cpu()[pages, rows], v_cache.cpu()[pages, rows]


def attend(q, k, v, scale: float, mask=None, softcap=None, sinks=None):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (o [Tq, Hq, D] fp64, lse [Tq, Hq] fp64, natural log).

    ``mask [Tq, Tk]`` bool, True = attend. A row with no keys gives o = 0, lse = -inf.
    ``softcap``: scores ``x`` become ``softcap * tanh(x / softcap)`` (Gemma 2). ``sinks [Hq]``: a
    logit per head in every row's softmax denominator, with value 0 (gpt-oss); lse includes it.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Tq]
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.einsum("hqk,khd->qhd", p, v)
    lse = lse.transpose(0, 1)
    if sinks is not None:
        total = torch.logaddexp(lse, sinks.double().cpu()[None, :])
        o = o * torch.exp(lse - total)[..., None]
        lse = total
    return o, lse


def decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale=None, softcap=None, sinks=None, window=None):
    """q [B, Hq, D] -> (o [B, Hq, D] fp64, lse [B, Hq] fp64). ``window``: keys at positions
    ``> seq_len - 1 - window`` only. Also the reference of cascade decode (the same result; the
    shared prefixes are only a way to compute it)."""
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    outs, lses = [], []
    for b, n in enumerate(seq_lens.tolist()):
        k, v = gather_kv(k_cache, v_cache, block_table, n, b)
        mask = None if window is None else (torch.arange(n) > n - 1 - window)[None, :]
        o, lse = attend(q[b:b + 1].cpu(), k, v, scale, mask, softcap=softcap, sinks=sinks)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


cascade_reference = decode_reference


def prefill_reference(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, causal=True, scale=None,
                      softcap=None, sinks=None, window=None):
    """q [T, Hq, D]: request i's queries are its last q_len_i tokens -> (o [T, Hq, D], lse [T, Hq]).
    ``causal`` is bottom-right aligned: query ``i`` of a request sees keys ``0 .. seq_len - q_len + i``.
    ``window`` (causal): the query at position p sees keys at ``p - window < pos <= p``."""
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    qsl = query_start_loc.tolist()
    outs, lses = [], []
    for b, n in enumerate(seq_lens.tolist()):
        qi = q[qsl[b]:qsl[b + 1]].cpu()
        k, v = gather_kv(k_cache, v_cache, block_table, n, b)
        mask = None
        if causal:
            qpos = torch.arange(n - qi.shape[0], n)
            mask = torch.arange(n)[None, :] <= qpos[:, None]
            if window is not None:
                mask &= torch.arange(n)[None, :] > qpos[:, None] - window
        o, lse = attend(qi, k, v, scale, mask, softcap=softcap, sinks=sinks)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
