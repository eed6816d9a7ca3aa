"""The Hopper decode (kernels/decode_sm90.py) inside ``paged_decode``, over fp8 and 16-bit caches, against
the fp64 reference (fp8: on the dequantized cache), on an sm_90 GPU. Each case asserts which kernel
ran; other machines skip the file (tests/test_decode.py and tests/test_fp8.py cover the portable
kernel everywhere)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.kernels import decode as D
from paged_backend.kernels.dispatch import SM90_TRITON, triton_release
from tests.paged_inputs import (make_block_table, make_cache, make_fp8_cache, misaligned, of_fused_rows,
                                poison_outside)
from tests.reference import assert_close_state, decode_reference

hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
         and triton_release() in SM90_TRITON),
    reason=f"needs an sm_90 GPU (H100/H200) and a Triton release the Gluon kernels were checked on {SM90_TRITON}")
pytestmark = [pytest.mark.gpu, hopper]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
SCALES = dict(k_scale=0.05, v_scale=0.02)


@pytest.fixture
def ran(monkeypatch):
    """-> the list of whether each decode call took the Hopper kernel (any plan size takes it here)."""
    from paged_backend.kernels import decode_sm90
    monkeypatch.setattr(decode_sm90, "MIN_TILES_PER_PROGRAM", 0)
    seen, view = [], D._sm90_view

    def spy(*args):
        got = view(*args)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(D, "_sm90_view", spy)
    return seen


def _inputs(lens, hq, hkv, d, bs, kv_dtype, q_dtype, layout="nhd", seed=0):
    """-> (q, k, v, block_table, seq_lens, scales, k and v as the reference reads them)."""
    torch.manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 3
    fp8 = kv_dtype.itemsize == 1
    if fp8:
        k, v = make_fp8_cache(nb, bs, hkv, d, kv_dtype, SCALES["k_scale"], SCALES["v_scale"], device="cuda",
                              layout=layout)
    else:
        k, v = make_cache(nb, bs, hkv, d, kv_dtype, device="cuda", layout=layout)
    bt = make_block_table(lens, bs, nb, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = (torch.randn(len(lens), hq, d, device="cuda") * (4 if fp8 else 1)).to(q_dtype)
    ref_kv = (k.float() * SCALES["k_scale"], v.float() * SCALES["v_scale"]) if fp8 else (k, v)
    poison_outside(k, v, bt, sl, float("nan"))  # slots past each sequence must never count
    return q, k, v, bt, sl, SCALES if fp8 else {}, ref_kv


KV_Q = [(torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e4m3fn, torch.float16),
        (torch.float8_e5m2, torch.bfloat16), (torch.float8_e5m2, torch.float16),
        (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


@pytest.mark.parametrize("kv_q", KV_Q, ids=lambda t: f"{str(t[0])[6:]}-q_{str(t[1])[6:]}")
@pytest.mark.parametrize("shape", ["32/8/128/16", "8/8/64/32", "16/1/128/16", "16/2/64/256"])
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_matches_the_reference(ran, kv_q, shape, layout):
    """Ragged lengths (empty, one key, mid-page, past a tile, stream-K cuts), every group size the
    kernel takes (1 -> 8 columns ... 16), page sizes below, at and above a tile, both cache layouts,
    NaN in every slot no sequence holds."""
    hq, hkv, d, bs = map(int, shape.split("/"))
    lens = [0, 1, 63, 64, 65, 1000, 4099, 17]
    q, k, v, bt, sl, scales, ref_kv = _inputs(lens, hq, hkv, d, bs, *kv_q, layout)
    plan = pb.plan_decode(np.array(lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                          device="cuda", kv_dtype=k.dtype)  # (fp8: three programs an SM, group 16 included)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan, **scales)
    assert ran == [True]
    assert_close_state(out, lse, *decode_reference(q, *ref_kv, bt, sl), kv_q[1], TOL[kv_q[1]])
    again = pb.paged_decode(q, k, v, bt, sl, plan=plan, **scales)  # the relaunch: the same bits
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_long_rows_split_over_programs_and_upper_bound_plans(ran, kv_dtype):
    """Few long requests (each cut over many programs, folded), a call without a plan (planned at
    the table's capacity, bounded by the device lengths in the kernel), and plans of 1 to 4 programs an
    SM (each launched with its own register and ring budget)."""
    lens = [70000, 33, 20001]
    q, k, v, bt, sl, scales, ref_kv = _inputs(lens, 32, 8, 128, 16, kv_dtype, torch.bfloat16)
    ref = decode_reference(q, *ref_kv, bt, sl)
    shape = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda")
    plan = pb.plan_decode(np.array(lens), kv_dtype=kv_dtype, **shape)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.num_programs == sms * (3 if kv_dtype.itemsize == 1 else 2)
    tol = TOL[torch.bfloat16]
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan, **scales)
    assert_close_state(out, lse, *ref, torch.bfloat16, tol)
    assert_close_state(*pb.paged_decode(q, k, v, bt, sl, **scales), *ref, torch.bfloat16, tol)
    for per_sm in (1, 2, 3, 4):
        other = pb.plan_decode(np.array(lens), num_programs=sms * per_sm, **shape)
        assert_close_state(*pb.paged_decode(q, k, v, bt, sl, plan=other, **scales), *ref, torch.bfloat16, tol)
    assert ran == [True] * 6


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_graph_replay_follows_new_lengths(ran, kv_dtype):
    """A captured decode replays with the lengths and queries of each step (a plan from upper bounds)."""
    lens = [3000, 129, 64]
    q, k, v, bt, sl, scales, ref_kv = _inputs(lens, 32, 8, 128, 16, kv_dtype, torch.bfloat16)
    plan = pb.plan_decode(np.array(lens), num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                          kv_dtype=kv_dtype)
    step_sl = sl - 40
    out, lse = pb.paged_decode(q, k, v, bt, step_sl, plan=plan, **scales)  # compiles and binds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pb.paged_decode(q, k, v, bt, step_sl, plan=plan, out=out, lse_out=lse, **scales)
    for back in (30, 0):
        step_sl.copy_(sl - back)
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
        graph.replay()
        assert_close_state(out, lse, *decode_reference(q, *ref_kv, bt, step_sl), torch.bfloat16, TOL[torch.bfloat16])
    assert all(ran)


@pytest.mark.parametrize("kv_q", KV_Q[::2] + KV_Q[5:], ids=lambda t: f"{str(t[0])[6:]}-q_{str(t[1])[6:]}")
@pytest.mark.parametrize("kind", ["softcap", "sinks", "both"])
def test_softcap_and_sinks(ran, kv_q, kind):
    """Soft-capped scores (scores far past the cap among them) and sinks of both signs: a request of
    length 0 (out = 0, lse = sink), short ones written whole by the kernel (it adds the sinks), long ones
    cut over programs (the fold adds them)."""
    lens = [0, 1, 63, 1000, 4099, 70000]
    hq = 32
    q, k, v, bt, sl, scales, ref_kv = _inputs(lens, hq, 8, 128, 16, *kv_q)
    kw = {}
    if kind != "sinks":
        kw["softcap"] = 5.0
    if kind != "softcap":
        kw["sinks"] = torch.linspace(-2.0, 16.0, hq, device="cuda")
    plan = pb.plan_decode(np.array(lens), num_q_heads=hq, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                          kv_dtype=k.dtype)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan, **kw, **scales)
    assert ran == [True]
    assert_close_state(out, lse, *decode_reference(q, *ref_kv, bt, sl, **kw), kv_q[1], TOL[kv_q[1]])
    again = pb.paged_decode(q, k, v, bt, sl, plan=plan, **kw, **scales)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("kw", [dict(window=100), dict(fp32=True)])
def test_what_it_does_not_take_runs_the_portable_kernel(ran, kw):
    lens = [500, 77]
    q_dtype = torch.float32 if kw.pop("fp32", False) else torch.bfloat16
    q, k, v, bt, sl, scales, _ = _inputs(lens, 32, 8, 128, 16, torch.float8_e4m3fn, q_dtype)
    out, lse = pb.paged_decode(q, k, v, bt, sl, **kw, **scales)
    assert ran == [False] and torch.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("view", ["of_qkv", "unaligned"])
def test_query_views(ran, kv_dtype, view):
    """The queries as a view of a fused QKV projection's rows (the loader reads them by TMA: the Hopper kernel)
    and at an address TMA cannot read (the portable kernel runs the call); both exact."""
    lens = [3000, 129, 0, 64]
    q, k, v, bt, sl, scales, ref_kv = _inputs(lens, 32, 8, 128, 16, kv_dtype, torch.bfloat16)
    qv = of_fused_rows(q, 2 * 8) if view == "of_qkv" else misaligned(q)
    plan = pb.plan_decode(np.array(lens), num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                          kv_dtype=kv_dtype)
    out, lse = pb.paged_decode(qv, k, v, bt, sl, plan=plan, **scales)
    assert ran == [view == "of_qkv"]
    assert_close_state(out, lse, *decode_reference(q, *ref_kv, bt, sl), torch.bfloat16, TOL[torch.bfloat16])


def test_small_plans_take_the_portable_kernel():
    """Under ``MIN_TILES_PER_PROGRAM`` tiles a program the call is host-bound: the portable kernel's
    launch is the cheaper one. The same call over a longer context takes the Hopper kernel."""
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda")
    for lens, want in (([4096], False), ([65536], True)):
        q, k, v, bt, sl, _, ref_kv = _inputs(lens, 32, 8, 128, 16, torch.bfloat16, torch.bfloat16)
        plan = pb.plan_decode(np.array(lens), **kw)
        assert (D._sm90_view(q, k, v, plan) is not None) == want
        assert_close_state(*pb.paged_decode(q, k, v, bt, sl, plan=plan), *decode_reference(q, *ref_kv, bt, sl),
                           torch.bfloat16, TOL[torch.bfloat16])
