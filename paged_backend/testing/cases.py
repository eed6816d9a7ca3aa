"""The conformance cases: small named batches, each with the features it exercises.

A :class:`Case` is a plain spec (lengths, heads, dtypes, feature settings); ``case.build(device)``
makes its :class:`CaseInputs` (deterministic per case name and seed) and ``inputs.reference()``
the fp64 reference state. ``CASES`` lists them all; ``QUICK`` the ``--quick`` subset (every op
and the main features once, no bf16, so it also runs under Triton's interpreter).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from .inputs import (FP8, make_block_table, make_cache, make_fp8_cache, make_shared_prefix_table, pad_table,
                     poison_outside, strided)
from .reference import decode_reference, dequantize, prefill_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
K_SCALE, V_SCALE = 0.05, 0.02  # fp8 cases: real values ~N(0, 1) stored as x / scale
RENAMED = {"padding": "padding_rows", "strided": "strided_metadata", "scale": "custom_scale"}  # field -> feature


@dataclass(frozen=True)
class Case:
    """One conformance case.

    ``op``: "decode" (``q [B, Hq, D]``), "prefill" (``q [T, Hq, D]``, ``query_start_loc``) or
    "cascade" (decode of a batch whose requests share leading blocks). ``lens``: the requests'
    key counts; for cascade the groups ``((prefix_blocks, (tail_len, ...)), ...)``
    (:func:`~paged_backend.testing.inputs.make_shared_prefix_table`). ``q_lens``: prefill's query
    counts (each request's last tokens). ``dtype``: q's dtype (and the cache's unless
    ``kv_dtype``, an fp8 dtype). ``poison``: "nan" (NaN in K and V) or "inf" (+inf in K, -inf in
    V) in every cache slot outside the rows. ``padding``: that many padding requests (length 0,
    no queries) appended, and every table entry past a row's blocks set to a real (poisoned if
    ``poison``) block id. ``strided``: block_table, seq_lens and query_start_loc passed as
    strided views. ``q_scale``: queries ~N(0, q_scale^2) (soft-capping needs large scores).
    """
    name: str
    op: str
    lens: tuple
    q_lens: tuple = ()
    dtype: torch.dtype = F16
    kv_dtype: torch.dtype | None = None
    heads: tuple = (8, 2)
    head_dim: int = 64
    block_size: int = 16
    layout: str = "nhd"
    causal: bool = True
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    poison: str | None = None
    padding: int = 0
    strided: bool = False
    q_scale: float = 1.0
    quick: bool = False
    doc: str = ""

    @property
    def features(self) -> frozenset:
        """Names of what the case exercises (adapters decide support from these)."""
        hq, hkv = self.heads
        f = {self.op, {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype],
             "mha" if hq == hkv else ("mqa" if hkv == 1 else "gqa")}
        lens = list(self.lens) if self.op != "cascade" else [p * self.block_size + t for p, ts in self.lens for t in ts]
        if self.op == "cascade":
            f.add("shared_prefix")
        if len(set(lens)) > 1:
            f.add("ragged")
        if 0 in lens or 0 in self.q_lens or self.padding:
            f.add("empty_rows")
        if max(lens) >= 1000:
            f.add("long")
        if self.op == "prefill":
            f.add("causal" if self.causal else "noncausal")
            if any(ql < n for ql, n in zip(self.q_lens, self.lens)):
                f.add("chunked")
        for name in ("window", "softcap", "sinks", "padding", "strided", "scale"):
            if getattr(self, name):
                f.add(RENAMED.get(name, name))
        if self.kv_dtype is not None:
            f |= {"fp8", str(self.kv_dtype).split("_")[1]}  # "e4m3fn" / "e5m2"
        if self.layout == "vllm":
            f.add("vllm_layout")
        if self.poison:
            f.add(f"{self.poison}_outside")
        return frozenset(f)

    def build(self, device="cpu", seed: int = 0) -> "CaseInputs":
        """The case's tensors on ``device``; the same values for the same name and seed."""
        device = torch.device(device)
        forked = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked):
            torch.manual_seed(zlib.crc32(self.name.encode()) + 7919 * seed)
            return self._build(device)

    def _build(self, device) -> "CaseInputs":
        hq, hkv = self.heads
        d, bs = self.head_dim, self.block_size
        if self.op == "cascade":
            bt, sl, nb = make_shared_prefix_table(self.lens, bs)
            bt, sl = bt.to(device), sl.to(device)
        else:
            lens = list(self.lens) + [0] * self.padding
            nb = sum(-(-n // bs) for n in lens) + 3
            bt = make_block_table(lens, bs, nb, device=device)
            sl = torch.tensor(lens, dtype=torch.int32, device=device)
            if self.padding:
                bt = pad_table(bt, sl, bs, pad_block=nb - 1)  # a spare block: never read
        if self.kv_dtype is not None:
            k, v = make_fp8_cache(nb, bs, hkv, d, self.kv_dtype, K_SCALE, V_SCALE, device, self.layout)
        else:
            k, v = make_cache(nb, bs, hkv, d, self.dtype, device, self.layout)
        if self.poison == "nan":
            poison_outside(k, v, bt, sl, float("nan"))
        elif self.poison == "inf":
            poison_outside(k, v, bt, sl, float("inf"), "k")
            poison_outside(k, v, bt, sl, float("-inf"), "v")
        qsl = None
        if self.op == "prefill":
            q_lens = list(self.q_lens) + [0] * self.padding
            qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
            rows = int(qsl[-1])
        else:
            rows = len(sl)
        q = (torch.randn(rows, hq, d, device=device) * self.q_scale).to(self.dtype)
        sinks = (torch.randn(hq, device=device) * 2).float() if self.sinks else None
        if self.strided:
            bt, sl = strided(bt), strided(sl)
            qsl = None if qsl is None else strided(qsl)
        fp8 = self.kv_dtype is not None
        return CaseInputs(self, q, k, v, bt, sl, qsl, sinks, K_SCALE if fp8 else None, V_SCALE if fp8 else None)


@dataclass
class CaseInputs:
    """A built case. ``q``: ``[B, Hq, D]`` (decode, cascade) or ``[T, Hq, D]`` (prefill);
    ``k_cache``, ``v_cache`` ``[NB, BS, Hkv, D]`` (fp8 with ``k_scale``/``v_scale`` floats, else
    those are None); ``block_table [B, max_blocks]`` int32; ``seq_lens [B]`` int32;
    ``query_start_loc [B+1]`` int32 (prefill, else None); ``sinks [Hq]`` float32 or None. The
    other settings (``op``, ``causal``, ``scale``, ``window``, ``softcap``) are the case's."""
    case: Case
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None
    sinks: torch.Tensor | None
    k_scale: float | None
    v_scale: float | None
    _ref: tuple | None = field(default=None, repr=False)

    op = property(lambda self: self.case.op)
    causal = property(lambda self: self.case.causal)
    scale = property(lambda self: self.case.scale)
    window = property(lambda self: self.case.window)
    softcap = property(lambda self: self.case.softcap)

    def host_lens(self) -> list:
        """``seq_lens`` as a list of ints."""
        return [int(n) for n in self.seq_lens.cpu().tolist()]

    def reference(self):
        """-> (o, lse) float64 on the CPU, lse natural log (fp8: on the dequantized cache). Cached."""
        if self._ref is None:
            k, v = dequantize(self.k_cache, self.k_scale), dequantize(self.v_cache, self.v_scale)
            kw = dict(scale=self.scale, softcap=self.softcap, sinks=self.sinks, window=self.window)
            if self.op == "prefill":
                self._ref = prefill_reference(self.q, k, v, self.block_table, self.seq_lens.cpu(),
                                              self.query_start_loc.cpu(), causal=self.causal, **kw)
            else:
                self._ref = decode_reference(self.q, k, v, self.block_table, self.seq_lens.cpu(), **kw)
        return self._ref


def _c(name, op, lens, **kw) -> Case:
    return Case(name, op, tuple(lens), **kw)


GROUPS = ((3, (5, 16, 1, 0)), (2, (7, 30)), (0, (21,)))  # 2 shared prefixes + an unrelated request
CASES = [
    # decode
    _c("decode_ragged", "decode", (1, 37, 200, 5, 64, 16), quick=True, doc="shuffled pages, ragged lengths"),
    _c("decode_empty_rows", "decode", (0, 17, 0, 3, 48), dtype=F32, quick=True, doc="requests with no keys"),
    _c("decode_long", "decode", (1500, 731, 1), doc="long rows"),
    _c("decode_page_size_1", "decode", (3, 9, 1), dtype=F32, block_size=1),
    _c("decode_mha_scale", "decode", (33, 5), dtype=F32, heads=(4, 4), scale=0.1, doc="Hq == Hkv, scale given"),
    _c("decode_mqa", "decode", (40, 7, 129), dtype=BF16, heads=(8, 1)),
    _c("decode_gqa8_d128", "decode", (70, 3), dtype=BF16, heads=(16, 2), head_dim=128),
    _c("decode_window", "decode", (1, 20, 90, 200, 0), window=24, quick=True),
    _c("decode_softcap", "decode", (1, 50, 130), dtype=F32, softcap=5.0, q_scale=4.0, quick=True),
    _c("decode_sinks", "decode", (0, 1, 50, 130), sinks=True, quick=True),
    _c("decode_fp8_e4m3", "decode", (1, 37, 200, 0), kv_dtype=E4M3, quick=True),
    _c("decode_fp8_e5m2", "decode", (1, 37, 200), dtype=BF16, kv_dtype=E5M2),
    _c("decode_vllm_layout", "decode", (20, 5, 33, 1), layout="vllm", quick=True),
    _c("decode_strided_metadata", "decode", (20, 5, 33, 1), dtype=F32, strided=True),
    _c("decode_padding_rows", "decode", (20, 5, 33), padding=2, poison="nan", doc="vLLM's padding requests"),
    _c("decode_nan_outside", "decode", (20, 5, 33, 1, 16, 0), dtype=F32, poison="nan", quick=True),
    _c("decode_inf_outside", "decode", (20, 5, 33, 1, 16, 0), layout="vllm", poison="inf"),
    _c("decode_all_features", "decode", (1, 40, 77, 0), dtype=BF16, layout="vllm", window=30, softcap=8.0,
       sinks=True, poison="nan", padding=1, strided=True, q_scale=3.0),
    # prefill
    _c("prefill_causal", "prefill", (40, 17, 1, 64), q_lens=(40, 17, 1, 64), quick=True, doc="whole prompts"),
    _c("prefill_chunked", "prefill", (90, 40, 33), q_lens=(17, 40, 9), dtype=F32, quick=True,
       doc="chunks over cached prefixes (query shorter than keys, not page-aligned)"),
    _c("prefill_ragged_mixed", "prefill", (50, 33, 16, 7, 0), q_lens=(50, 5, 1, 0, 0), dtype=BF16,
       doc="prompts, a chunk, a decode row, rows without queries or keys"),
    _c("prefill_noncausal", "prefill", (60, 25), q_lens=(20, 25), dtype=F32, causal=False),
    _c("prefill_mqa", "prefill", (45, 30), q_lens=(45, 10), heads=(8, 1)),
    _c("prefill_window", "prefill", (70, 40, 9), q_lens=(70, 15, 1), window=13),
    _c("prefill_softcap_sinks", "prefill", (50, 30), q_lens=(50, 6), dtype=F32, softcap=5.0, sinks=True, q_scale=4.0),
    _c("prefill_fp8_e4m3", "prefill", (40, 90, 33), q_lens=(40, 17, 1), kv_dtype=E4M3, window=24),
    _c("prefill_fp8_e5m2", "prefill", (40, 90), q_lens=(40, 17), dtype=F32, kv_dtype=E5M2),
    _c("prefill_vllm_nan_strided", "prefill", (20, 5, 33, 16, 7), q_lens=(4, 5, 1, 16, 0), layout="vllm",
       poison="nan", padding=1, strided=True),
    # cascade
    _c("cascade_shared_prefix", "cascade", GROUPS, quick=True, doc="two shared prefixes + tails"),
    _c("cascade_window", "cascade", GROUPS, dtype=F32, window=20),
    _c("cascade_softcap_sinks", "cascade", GROUPS, softcap=5.0, sinks=True, q_scale=4.0),
    _c("cascade_fp8_e5m2", "cascade", GROUPS, kv_dtype=E5M2),
    _c("cascade_vllm_inf_strided", "cascade", GROUPS, dtype=F32, layout="vllm", poison="inf", strided=True),
]
QUICK = [c for c in CASES if c.quick]
assert len({c.name for c in CASES}) == len(CASES)
assert all(c.kv_dtype in (None, *FP8) for c in CASES)
