"""Values outside every request's rows never reach an output, and metadata is read with its strides.

vLLM's attention tests fill the cache slots no sequence owns with NaN ("the result must not depend
on values beyond each sequence"): real pools hold garbage there (``torch.empty``, blocks freed by
other requests, fp8 bytes that encode NaN). Each op runs on a cache poisoned with NaN / +-inf
outside every row's ``[0, seq_len)`` (unused rows of last blocks, blocks that only padding entries
of the table point to, unused blocks), with every index tensor also passed as a strided view, and
must equal the dense reference (and, for strided metadata, the contiguous call bit for bit).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade.plan import CascadeCost
from paged_backend.kernels.dispatch import use_sm90
from paged_backend.prefill import prefill_kernel_name
from paged_inputs import make_cache, make_decode_inputs, pad_table, poison_outside, strided
from reference import assert_close_state, decode_reference, prefill_reference

pytestmark = pytest.mark.kernel

GPU = pytest.param("cuda", marks=[pytest.mark.gpu,
                                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])
DEVICES = ["cpu", GPU]
NAN, INF = float("nan"), float("inf")
# (poison value, which cache, layout, dtype): every value of each axis at least once
CASES = [(NAN, "kv", "nhd", torch.float32), (NAN, "v", "vllm", torch.float16), (INF, "k", "nhd", torch.float16),
         (-INF, "kv", "vllm", torch.float32), (INF, "v", "nhd", torch.float32), (-INF, "k", "vllm", torch.float16)]


def _dtype(dtype, device):
    # the interpreter has no bf16 arithmetic; on the GPU bf16 replaces fp16 (the kernels' dtype there)
    return torch.bfloat16 if device == "cuda" and dtype == torch.float16 else dtype


def _poisoned_decode_inputs(lens, hq, hkv, d, bs, value, which, layout, dtype, device, seed):
    torch.manual_seed(seed)
    q, k, v, bt, sl = make_decode_inputs(lens, hq, hkv, d, bs, dtype, device=device, layout=layout, spare_blocks=3)
    bt = pad_table(bt, sl, bs, pad_block=k.shape[0] - 1)  # padding points at a (poisoned) spare block
    poison_outside(k, v, bt, sl, value, which)
    return q, k, v, bt, sl


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [None, "stream_k", "split"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode(case, mode, device):
    value, which, layout, dtype = CASES[case]
    dtype = _dtype(dtype, device)
    lens = [20, 5, 33, 1, 16, 0]
    q, k, v, bt, sl = _poisoned_decode_inputs(lens, 8, 2, 64, 16, value, which, layout, dtype, device, case)
    plan = None if mode is None else pb.plan_decode(lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                                                    device=device, mode=mode, block_n=16)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl), dtype)
    out_s, lse_s = pb.paged_decode(q, k, v, strided(bt), strided(sl), plan=plan)
    assert torch.equal(out_s, out) and torch.equal(lse_s, lse), "strided metadata changed the result"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill(case, causal, device):
    value, which, layout, dtype = CASES[case]
    dtype = _dtype(dtype, device)
    lens, q_lens = [20, 5, 33, 16, 7], [4, 5, 1, 16, 0]
    _, k, v, bt, sl = _poisoned_decode_inputs(lens, 8, 2, 64, 16, value, which, layout, dtype, device, case)
    qsl = torch.tensor(np.r_[0, np.cumsum(q_lens)], dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), 8, 64, device=device).to(dtype)
    if device == "cuda" and dtype != torch.float32 and use_sm90(q.device):  # the half cases run the Hopper kernel
        assert prefill_kernel_name(q, k, v) == "sm90"
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl, causal=causal)
    assert_close_state(out, lse, *prefill_reference(q, k, v, bt, sl, qsl, causal=causal), dtype)
    out_s, lse_s = pb.paged_prefill(q, k, v, strided(bt), strided(sl), strided(qsl), causal=causal)
    assert torch.equal(out_s, out) and torch.equal(lse_s, lse), "strided metadata changed the result"


def test_sm90_prefill_launcher_passes_metadata_strides(monkeypatch):
    """(CPU, launcher only) The Hopper prefill kernel gets the metadata views themselves (no copies)
    with their strides - it reads ``block_table[b, j]`` at ``b * stride_btb + j * stride_btn``,
    ``seq_lens[b]`` at ``b * stride_sl``, ``query_start_loc[b]`` at ``b * stride_qsl`` - and
    otherwise the contiguous call's arguments and grid. test_prefill's half-precision GPU cases run
    the kernel itself on sm_90."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from paged_backend.kernels import prefill_sm90 as sm90
    lens, q_lens = [20, 5, 33, 16, 7], [4, 5, 1, 16, 0]
    _, k, v, bt, sl = make_decode_inputs(lens, 8, 2, 64, 16, torch.bfloat16, layout="vllm")
    qsl = torch.tensor(np.r_[0, np.cumsum(q_lens)], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), 8, 64).to(torch.bfloat16)
    cfg = sm90.sm90_config(q, k, v, 0.0, 0, (None, None))
    assert cfg is not None
    calls = []
    monkeypatch.setattr(sm90, "launch", lambda fn, grid, *args, **kw: calls.append(
        (grid, dict(zip(fn.arg_names, args)), kw)))
    wide = torch.full((len(lens) + 1, 5), -7, dtype=torch.int32)  # columns of a wider buffer
    wide[:, 3] = qsl
    wide[:-1, 1] = sl
    views = [(bt, sl, qsl), (strided(bt), strided(sl), strided(qsl)),
             (bt.t().contiguous().t(), wide[:-1, 1], wide[:, 3]), (strided(bt.t()).t(), strided(sl), wide[:, 3])]
    for meta in views:
        sm90.prefill_sm90(q, k, v, *meta, 0.125, True, torch.empty_like(q), torch.empty(q.shape[:2]), cfg)
    meta_args = {"bt_ptr": 0, "seq_lens_ptr": 1, "qsl_ptr": 2}
    strides = {"stride_btb": (0, 0), "stride_btn": (0, 1), "stride_sl": (1, 0), "stride_qsl": (2, 0)}
    grid0, args0, kw0 = calls[0]
    assert [*args0, *(n for n in kw0 if n not in args0 and n != "num_warps")] == sm90._prefill_sm90_kernel.arg_names
    assert strides.keys() <= args0.keys()
    for (grid, args, kw), meta in zip(calls, views):
        assert grid == grid0 and kw == kw0 and args.keys() == args0.keys()
        for name, arg in args.items():
            if name in meta_args:
                assert arg is meta[meta_args[name]], name
            elif name in strides:
                t, dim = strides[name]
                assert arg == meta[t].stride(dim), name
            elif isinstance(arg, (int, float)):
                assert arg == args0[name], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cascade(case, device):
    """Four samples of a 3-block prompt plus an unrelated request; tails end mid-block."""
    value, which, layout, dtype = CASES[case]
    dtype = _dtype(dtype, device)
    bs, hq, hkv, d = 16, 8, 2, 64
    torch.manual_seed(case)
    k, v = make_cache(14, bs, hkv, d, dtype, device=device, layout=layout)
    prompt = [7, 2, 11]
    table = torch.tensor([prompt + [0, 13], prompt + [1, 13], prompt + [3, 13], prompt + [13, 13],
                          [5, 6, 13, 13, 13]], dtype=torch.int32)  # 13: padding, never written
    lens = torch.tensor([3 * bs + 5, 3 * bs + 16, 3 * bs + 1, 3 * bs, 2 * bs - 3], dtype=torch.int32)
    poison_outside(k, v, table, lens, value, which)
    q = torch.randn(5, hq, d, device=device).to(dtype)
    ref = decode_reference(q, k, v, table, lens)
    results = []
    for bt_host, sl_host, bt_dev in ((table, lens, None),
                                     (strided(table), strided(lens).numpy(), strided(table.to(device)))):
        cplan = pb.plan_cascade(bt_host, sl_host, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                device=device, cost=CascadeCost(0, 0, 0), block_table_device=bt_dev)
        assert cplan.num_nodes == 1
        results.append(pb.cascade_decode(q, k, v, cplan))
        assert_close_state(*results[-1], *ref, dtype)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_and_copy_blocks_strided(device):
    torch.manual_seed(1)
    nb, bs, hkv, d = 10, 4, 2, 64
    caches = [make_cache(nb, bs, hkv, d, torch.float32, device=device, layout=lay) for lay in ("nhd", "vllm")]
    key, value = torch.randn(7, hkv, d, device=device), torch.randn(7, hkv, d, device=device)
    slots = torch.tensor([3, 17, -1, 30, 4, 39, 0], dtype=torch.int64, device=device)
    copies = torch.tensor([[1, 8], [1, 9], [2, 7]], dtype=torch.int64, device=device)
    done = []
    for slot_mapping, block_copies in ((slots, copies), (strided(slots), copies.t().contiguous().t()),
                                       (strided(slots), strided(copies.t()).t())):
        kv = [(k.clone(), v.clone()) for k, v in caches]
        for k, v in kv:
            pb.write_kv(key, value, k, v, slot_mapping)
        pb.copy_blocks([k for k, _ in kv], [v for _, v in kv], block_copies)
        done.append(kv)
    for kv in done[1:]:
        for (k0, v0), (k1, v1) in zip(done[0], kv):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    k0 = done[0][0][0]
    assert torch.equal(k0[7], k0[2]) and torch.equal(k0[8], k0[1]) and torch.equal(k0[4, 1], key[1])

