"""Peers run side by side with ours on the same ``PagedInputs``: FlashInfer paged decode, torch
SDPA (flash backend) on dense contiguous KV, xformers ``triton_splitk`` on its own page-64 cache.

Each ``*_impl(inp)`` returns an :class:`Impl` or raises :class:`Skip` (not applicable) or any
other exception (recorded by the caller, never fatal). Imports are inside the functions so a
missing peer only skips that peer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common import PagedInputs, gather_request

LN2 = math.log(2.0)
FI_GROUPS = (1, 2, 3, 4, 8)  # group sizes FlashInfer's CUDA-core decode kernel dispatches


class Skip(Exception):
    """The peer does not apply to this case (the message says why)."""


@dataclass
class Impl:
    fns: list  # one zero-argument callable per input set
    result: object  # () -> (o [B, Hq, D], lse [B, Hq] natural log or None) on set 0
    note: str = ""


def fi_prefill_backend(backend: str, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """FlashInfer's prefill backend for these dtypes: ``auto`` is ``fa2`` where the queries' dtype is not the
    cache's - FlashInfer 0.2.14's own ``auto`` picks ``fa3`` on sm_90, whose kernels do not build for bf16 queries
    over an e4m3 cache (cute: "No eligible GMMA operator", H200, 2026-12-01)."""
    return "fa2" if backend == "auto" and q_dtype != kv_dtype else backend


def flashinfer_impl(inp: PagedInputs) -> Impl:
    """``BatchDecodeWithPagedKVCacheWrapper``, NHD, our page size and page table; planned once.
    Its CUDA-core kernel takes groups of 1, 2, 3, 4 or 8 query heads per KV head. MQA with a larger
    group runs it on ``Hq / 8`` stride-0 views of the one KV head (group 8; each view's bytes come
    from the L2 after the first, as in xformers' MQA): on an H100, B4x64K took 334 us, against
    369 us with 8 views (group 4) and 1058 us as paged prefill with the heads as query rows, while
    ``use_tensor_cores=True`` (group 32) killed the process. Other groups use tensor cores."""
    if inp.device.type != "cuda":
        raise Skip("needs CUDA")
    import flashinfer
    bs, lens = inp.block_size, inp.lens
    need = torch.tensor([-(-n // bs) for n in lens], dtype=torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(need, 0)
    live = torch.arange(inp.block_table.shape[1])[None, :] < need[:, None]
    indices = inp.block_table.cpu()[live].to(torch.int32)  # row-major: request by request
    last = torch.tensor([(n - 1) % bs + 1 if n > 0 else 0 for n in lens], dtype=torch.int32)
    hkv, views, note = inp.num_kv_heads, 1, ""
    tc = inp.group not in FI_GROUPS
    if tc and hkv == 1 and inp.num_q_heads % 8 == 0:
        hkv, tc = inp.num_q_heads // 8, False
        views, note = hkv, f"MQA: {hkv} stride-0 views of the KV head, group 8"
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=inp.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(indptr.to(inp.device), indices.to(inp.device), last.to(inp.device), inp.num_q_heads,
           hkv, inp.head_dim, bs, q_data_type=inp.dtype, kv_data_type=inp.kv_dtype or inp.dtype,
           window_left=inp.window - 1 if inp.window else -1)  # (FlashInfer: window_left keys before the query's)
    sets = [(q, k.expand(-1, -1, views, -1), v.expand(-1, -1, views, -1)) if views > 1 else (q, k, v)
            for q, k, v in inp.sets]
    fns = [lambda q=q, k=k, v=v: w.run(q, (k, v), return_lse=True) for q, k, v in sets]

    def result():
        o, lse2 = fns[0]()
        return o, lse2.float() * LN2  # FlashInfer's LSE is base 2
    return Impl(fns, result, note or ("tensor cores" if tc else ""))


def sdpa_impl(inp: PagedInputs) -> Impl:
    """torch SDPA, flash backend, dense contiguous KV ``[B, L, Hkv, D]`` (GQA via enable_gqa).
    Ragged batches are skipped (a padded batch would read more bytes than the work needs)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if inp.window or inp.kv_dtype:
        raise Skip("sliding window or fp8 KV (SDPA decode takes neither)")
    if len(set(inp.lens)) != 1:
        raise Skip("ragged batch")
    n, b = inp.lens[0], len(inp.lens)
    pos = torch.arange(n, device=inp.device)
    pages = inp.block_table.long()[:, pos // inp.block_size]  # [B, L]
    rows = (pos % inp.block_size)[None, :]
    backend = SDPBackend.FLASH_ATTENTION if inp.device.type == "cuda" else SDPBackend.MATH
    fns = []
    for q, k, v in inp.sets:
        kd = k[pages, rows].transpose(1, 2)  # [B, Hkv, L, D] view of a contiguous [B, L, Hkv, D]
        vd = v[pages, rows].transpose(1, 2)
        q4 = q.view(b, inp.num_q_heads, 1, inp.head_dim)

        def fn(q4=q4, kd=kd, vd=vd):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True)
        fns.append(fn)

    def result():
        return fns[0]()[:, :, 0, :], None
    return Impl(fns, result, "" if inp.device.type == "cuda" else "math backend (CPU)")


def xformers_impl(inp: PagedInputs, page: int = 64) -> Impl:
    """xformers ``triton_splitk.FwOp`` paged: its own shuffled page-64 cache holding the same K/V
    (its paged path needs page_size % 64 == 0), ``PagedBlockDiagonalPaddedKeysMask``."""
    if inp.device.type != "cuda":
        raise Skip("needs CUDA")
    if inp.window or inp.kv_dtype:
        raise Skip("sliding window or fp8 KV (not in its paged split-K decode)")
    from xformers.ops import fmha
    from xformers.ops.fmha import triton_splitk
    lens, b, dev = inp.lens, len(inp.lens), inp.device
    hq, hkv, d, g = inp.num_q_heads, inp.num_kv_heads, inp.head_dim, inp.group
    need = [-(-n // page) for n in lens]
    nb = sum(need) + 1
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    cols = max(need)
    table = torch.full((b, cols), int(perm[-1]), dtype=torch.int32)
    at = 0
    for i, m in enumerate(need):
        table[i, :m] = perm[at:at + m]
        at += m
    table = table.to(dev)
    bias = fmha.attn_bias.BlockDiagonalPaddedKeysMask.from_seqlens(
        q_seqlen=[1] * b, kv_padding=cols * page, kv_seqlen=lens, device=dev).make_paged(
        block_tables=table, page_size=page, paged_type=fmha.attn_bias.PagedBlockDiagonalPaddedKeysMask)

    def repage(cache):
        out = torch.zeros(nb, page, hkv, d, dtype=cache.dtype, device=dev)
        for i, n in enumerate(lens):
            pos = torch.arange(n, device=dev)
            out[table[i].long()[pos // page], pos % page] = gather_request(cache, inp.block_table, i, n)
        n_tok = nb * page
        if hkv == 1:  # MQA: BMHK with the one KV head expanded (as xformers' decoding benchmark)
            return out.view(1, n_tok, 1, d).expand(1, n_tok, hq, d)
        if g == 1:
            return out.view(1, n_tok, hkv, d)
        return out.view(1, n_tok, hkv, 1, d).expand(1, n_tok, hkv, g, d)  # BMGHK

    def qview(q):
        if hkv == 1:
            return q.view(1, b, hq, d)
        return q.view(1, b, hkv, d) if g == 1 else q.view(1, b, hkv, g, d)

    op = triton_splitk.FwOp
    sets = [(qview(q), repage(k), repage(v)) for q, k, v in inp.sets]
    q0, k0, v0 = sets[0]
    # The split-K op is pure Triton: the wheel's missing C++ extension (built for another torch)
    # does not concern it, so that one reason is ignored and the op is applied directly.
    reasons = [r for r in op.not_supported_reasons(fmha.Inputs(query=q0, key=k0, value=v0, attn_bias=bias))
               if "build with CUDA support" not in r]
    if reasons:
        raise RuntimeError(f"FwOp.not_supported_reasons: {reasons}")
    fns = [lambda q=q, k=k, v=v: op.apply(fmha.Inputs(query=q, key=k, value=v, attn_bias=bias),
                                          needs_gradient=False)[0]
           for q, k, v in sets]

    def result():
        return fns[0]().reshape(b, hq, d), None
    return Impl(fns, result, f"page {page}")


PEERS = {"flashinfer": flashinfer_impl, "sdpa": sdpa_impl, "xformers": xformers_impl}
