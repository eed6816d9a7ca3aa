"""Independent dense references: gather each request's pages into dense K/V and do plain fp64
softmax attention. Never calls code from the package."""
from __future__ import annotations

import torch


def gather_kv(k_cache, v_cache, block_table, seq_len: int, b: int):
    """Dense ``[seq_len, Hkv, D]`` K and V of request ``b``, token by token."""
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
    ``> seq_len - 1 - window`` only."""
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


def prefill_reference(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, causal=True, scale=None,
                      softcap=None, sinks=None, window=None):
    """q [T, Hq, D]: request i's queries are its last q_len_i tokens -> (o [T, Hq, D], lse [T, Hq]).
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


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
LSE_TOL = 1e-3


def assert_close_state(out, lse, ref_o, ref_lse, dtype, tol=None):
    """``tol``: the relative error allowed on ``out`` (default by dtype, ``TOL``)."""
    assert torch.isfinite(out).all(), "output has NaN/inf"
    err = rel_err(out, ref_o)
    tol = TOL[dtype] if tol is None else tol
    assert err <= tol, f"rel err {err:.3g} > {tol}"
    if lse is not None:
        lse, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
        assert not torch.isnan(lse).any(), "lse has NaN"
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), "lse -inf pattern differs"
        if fin.any():
            dl = (lse[fin] - ref_lse[fin]).abs().max().item()
            assert dl <= LSE_TOL, f"lse abs err {dl:.3g} > {LSE_TOL}"
