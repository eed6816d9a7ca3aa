"""Adapters: one small class per implementation, so the suite can run the same cases on each.

An adapter has a ``name`` and two methods (:class:`Adapter`):

- ``supports(case) -> True | str``: True, or why the implementation cannot run the case (a
  feature it cannot express, a package not installed, a device it needs); ``False`` also means
  not supported;
- ``run(inputs) -> (out, lse)``: ``out`` shaped like ``inputs.q``, ``lse [rows, Hq]`` natural log,
  or ``lse = None`` when the implementation gives none (then only ``out`` is compared). It may
  raise :class:`NotSupported` when it finds out at run time.

``ours`` runs paged_backend's ops; ``sdpa``, ``flashinfer``, ``xformers`` call the peers as
benchmarks/peers.py does (the peers are imported lazily: a missing package makes every case
"not supported: <package> not installed").
"""
from __future__ import annotations

import importlib
import math
from typing import Protocol

import torch

from .cases import Case, CaseInputs

LN2 = math.log(2.0)


class NotSupported(Exception):
    """Raised by ``run`` when an implementation finds it cannot run the case (message: why)."""


class Adapter(Protocol):
    name: str

    def supports(self, case: Case) -> bool | str: ...

    def run(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def live_pages(inp: CaseInputs):
    """Each request's used block ids, CSR style (FlashInfer's page table) -> (indptr [B+1],
    indices [pages], last_page_len [B]; 0 for an empty request), int32 on the CPU."""
    bs, lens = inp.k_cache.shape[1], inp.host_lens()
    need = torch.tensor([-(-n // bs) for n in lens], dtype=torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(need, 0)
    bt = inp.block_table.cpu()
    live = torch.arange(bt.shape[1])[None, :] < need[:, None]
    indices = bt[live].to(torch.int32)  # row-major: request by request
    last = torch.tensor([(n - 1) % bs + 1 if n > 0 else 0 for n in lens], dtype=torch.int32)
    return indptr, indices, last


class Ours:
    """paged_backend: ``plan_decode`` + ``paged_decode``, ``paged_prefill``, ``plan_cascade`` (cost
    model off, so every shared block is shared) + ``cascade_decode``."""
    name = "ours"

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def supports(self, case: Case) -> bool | str:
        from paged_backend.kernels.dispatch import INTERPRET
        if self.device.type == "cpu" and INTERPRET and case.dtype == torch.bfloat16:
            return "Triton's interpreter has no bf16 arithmetic"
        return True

    def run(self, inp: CaseInputs):
        import paged_backend as pb
        from paged_backend.cascade import CascadeCost
        q, k, v = inp.q, inp.k_cache, inp.v_cache
        hq, hkv, d, bs = q.shape[1], k.shape[2], k.shape[3], k.shape[1]
        kw = dict(scale=inp.scale, softcap=inp.softcap, sinks=inp.sinks, window=inp.window)
        if inp.k_scale is not None:
            kw.update(k_scale=inp.k_scale, v_scale=inp.v_scale)
        shape = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device=q.device, window=inp.window)
        if inp.op == "decode":
            plan = pb.plan_decode(inp.host_lens(), kv_dtype=k.dtype, **shape)
            return pb.paged_decode(q, k, v, inp.block_table, inp.seq_lens, plan=plan, **kw)
        if inp.op == "prefill":
            return pb.paged_prefill(q, k, v, inp.block_table, inp.seq_lens, inp.query_start_loc, causal=inp.causal,
                                    **kw)
        cplan = pb.plan_cascade(inp.block_table.cpu(), inp.seq_lens.cpu(), cost=CascadeCost(0, 0, 0),
                                block_table_device=inp.block_table, **shape)
        return pb.cascade_decode(q, k, v, cplan, **kw)


class Sdpa:
    """torch ``scaled_dot_product_attention``, one request at a time on its gathered dense K/V
    (fp8 caches dequantized to q's dtype first), masks for causal (bottom-right) and windows;
    sinks as one extra zero key whose additive mask is the sink's logit. No soft-capping; no
    LSE (only ``out`` is compared)."""
    name = "sdpa"
    note = "out only (SDPA returns no LSE)"

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def supports(self, case: Case) -> bool | str:
        return "SDPA has no logit soft-capping" if case.softcap else True

    def run(self, inp: CaseInputs):
        import torch.nn.functional as F
        q = inp.q
        hq, d = q.shape[1], q.shape[2]
        k, v = inp.k_cache, inp.v_cache
        if inp.k_scale is not None:
            k, v = (k.float() * inp.k_scale).to(q.dtype), (v.float() * inp.v_scale).to(q.dtype)
        bs, group = k.shape[1], hq // k.shape[2]
        out = torch.zeros_like(q)
        bt = inp.block_table.long()
        qsl = inp.query_start_loc.tolist() if inp.op == "prefill" else list(range(q.shape[0] + 1))
        for b, n in enumerate(inp.host_lens()):
            q0, q1 = qsl[b], qsl[b + 1]
            if n == 0 or q1 == q0:
                continue  # no keys: out = 0 (sinks too); no queries: nothing to do
            pos = torch.arange(n, device=q.device)
            pages = bt[b, pos // bs]
            kd = k[pages, pos % bs].repeat_interleave(group, 1).transpose(0, 1)[None]  # [1, Hq, n, D]
            vd = v[pages, pos % bs].repeat_interleave(group, 1).transpose(0, 1)[None]
            qpos = torch.arange(n - (q1 - q0), n, device=q.device)[:, None]
            mask = torch.ones(q1 - q0, n, dtype=torch.bool, device=q.device)
            if inp.causal or inp.op != "prefill":
                mask &= pos[None, :] <= qpos
                if inp.window is not None:
                    mask &= pos[None, :] > qpos - inp.window
            mask = mask[None, None].expand(1, hq, -1, -1)
            if inp.sinks is not None:  # a key of score `sink` and value 0
                kd = torch.cat([kd, kd.new_zeros(1, hq, 1, d)], 2)
                vd = torch.cat([vd, vd.new_zeros(1, hq, 1, d)], 2)
                bias = torch.zeros(1, hq, q1 - q0, n, device=q.device).masked_fill(~mask, float("-inf"))
                mask = torch.cat([bias, inp.sinks.float().view(1, hq, 1, 1).expand(1, hq, q1 - q0, 1)], 3).to(q.dtype)
            qd = q[q0:q1].transpose(0, 1)[None]  # [1, Hq, Tq, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=inp.scale)
            out[q0:q1] = o[0].transpose(0, 1)
        return out, None


class _Peer:
    """Shared by the peers: the lazy import and the CUDA requirement."""
    package = ""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        try:
            self.mod = importlib.import_module(self.package)
            self.missing = None
        except Exception as e:  # noqa: BLE001 - any import failure means not usable here
            self.mod, self.missing = None, f"{self.package} not installed ({type(e).__name__})"

    def supports(self, case: Case) -> bool | str:
        if self.missing:
            return self.missing
        if self.device.type != "cuda":
            return "needs CUDA"
        return self._supports(case)


class FlashInfer(_Peer):
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (decode, and cascade cases as flat
    decode) and ``BatchPrefillWithPagedKVCacheWrapper`` (prefill; causal is bottom-right), our
    page table as CSR indices, NHD (vLLM's layout as HND views), ``window_left = window - 1``,
    ``logits_soft_cap``, fp8 with ``k_scale``/``v_scale``; base-2 LSE converted to natural log."""
    name, package = "flashinfer", "flashinfer"
    groups = (1, 2, 3, 4, 8)  # query heads per KV head of its CUDA-core decode kernel

    def _supports(self, case):
        if case.sinks:
            return "no sinks in the paged decode/prefill wrappers"
        if case.dtype == torch.float32:  # its kernels dispatch fp16 / bf16 queries (fp8 KV beside them)
            return "fp32 inputs: its kernels take fp16 / bf16"
        return True

    def run(self, inp: CaseInputs):
        fi, q, k, v = self.mod, inp.q, inp.k_cache, inp.v_cache
        hq, hkv, d, bs = q.shape[1], k.shape[2], k.shape[3], k.shape[1]
        layout = "HND" if k.stride(2) > k.stride(1) else "NHD"  # vLLM's [NB, Hkv, BS, .] storage
        if layout == "HND":
            k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        indptr, indices, last = (t.to(q.device) for t in live_pages(inp))
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)
        kw = dict(q_data_type=q.dtype, kv_data_type=k.dtype, window_left=inp.window - 1 if inp.window else -1)
        if inp.softcap:
            kw["logits_soft_cap"] = inp.softcap
        if inp.scale is not None:
            kw["sm_scale"] = inp.scale
        run_kw = dict(k_scale=inp.k_scale, v_scale=inp.v_scale) if inp.k_scale is not None else {}
        if inp.op == "prefill":
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, layout)
            w.plan(inp.query_start_loc.contiguous(), indptr, indices, last, hq, hkv, d, bs, causal=inp.causal, **kw)
        else:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=hq // hkv not in self.groups)
            w.plan(indptr, indices, last, hq, hkv, d, bs, **kw)
        o, lse2 = w.run(q, (k, v), return_lse=True, **run_kw)
        return o, lse2.float() * LN2  # FlashInfer's LSE is base 2


class Xformers(_Peer):
    """xformers ``triton_splitk.FwOp`` paged decode (``PagedBlockDiagonalPaddedKeysMask``) on its
    own shuffled page-64 cache holding the same K/V (its paged path needs pages of 64); cascade
    cases run as flat decode. Only ``out`` is compared."""
    name, package = "xformers", "xformers"
    note = "out only"
    page = 64

    def _supports(self, case):
        if case.op == "prefill":
            return "this adapter covers xformers' paged split-K decode only"
        for feat, why in (("window", "sliding window"), ("softcap", "soft-capping"), ("sinks", "sinks"),
                          ("fp8", "fp8 KV"), ("custom_scale", "a given scale")):
            if feat in case.features:
                return f"{why}: not in its paged split-K decode"
        return True

    def run(self, inp: CaseInputs):
        from xformers.ops import fmha
        from xformers.ops.fmha import triton_splitk
        q, dev, page, lens = inp.q, inp.q.device, self.page, inp.host_lens()
        b, hq, d = q.shape
        hkv = inp.k_cache.shape[2]
        g, bs = hq // hkv, inp.k_cache.shape[1]
        need = [max(1, -(-n // page)) for n in lens]
        nb = sum(need)
        table = torch.arange(nb, dtype=torch.int32)[torch.randperm(nb)]
        table = torch.nn.utils.rnn.pad_sequence(list(table.split(need)), batch_first=True, padding_value=0).to(dev)
        bias = fmha.attn_bias.BlockDiagonalPaddedKeysMask.from_seqlens(
            q_seqlen=[1] * b, kv_padding=table.shape[1] * page, kv_seqlen=lens, device=dev).make_paged(
            block_tables=table, page_size=page, paged_type=fmha.attn_bias.PagedBlockDiagonalPaddedKeysMask)

        def repage(cache):
            out = torch.zeros(nb, page, hkv, d, dtype=cache.dtype, device=dev)
            for i, n in enumerate(lens):
                pos = torch.arange(n, device=dev)
                out[table[i].long()[pos // page], pos % page] = cache[inp.block_table[i].long()[pos // bs], pos % bs]
            n_tok = nb * page
            if hkv == 1:  # MQA: BMHK with the one KV head expanded
                return out.view(1, n_tok, 1, d).expand(1, n_tok, hq, d)
            if g == 1:
                return out.view(1, n_tok, hkv, d)
            return out.view(1, n_tok, hkv, 1, d).expand(1, n_tok, hkv, g, d)  # BMGHK

        qv = q.view(1, b, hq, d) if hkv == 1 or g == 1 else q.view(1, b, hkv, g, d)
        o = triton_splitk.FwOp.apply(fmha.Inputs(query=qv, key=repage(inp.k_cache), value=repage(inp.v_cache),
                                                 attn_bias=bias), needs_gradient=False)[0]
        return o.reshape(b, hq, d), None


BUILTIN = {"ours": Ours, "sdpa": Sdpa, "flashinfer": FlashInfer, "xformers": Xformers}


def get_adapter(spec, device="cpu") -> Adapter:
    """``spec``: a built-in name (``ours``, ``sdpa``, ``flashinfer``, ``xformers``), ``"module:attr"``
    (a class or factory called with ``device``, or an adapter object), an adapter class (called
    with ``device``) or an adapter object."""
    if isinstance(spec, type):
        return spec(device)
    if not isinstance(spec, str):
        return spec
    if spec in BUILTIN:
        return BUILTIN[spec](device)
    if ":" not in spec:
        raise ValueError(f"impl: {spec!r} is neither one of {sorted(BUILTIN)} nor 'module:attr'")
    mod, _, attr = spec.partition(":")
    obj = getattr(importlib.import_module(mod), attr)
    return obj(device) if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "run")) else obj
