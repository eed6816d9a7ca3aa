"""The Hopper cascade node kernel (kernels/cascade_sm90.py) inside ``cascade_decode``, against the dense
fp64 decode reference, on an sm_90 GPU. Each case asserts the node pieces really ran on it
(``cascade_node_kernel_name``); other machines skip the file (tests/test_cascade.py covers the
portable node kernel there). CUDA-graph replay: tests/test_cascade.py's GPU test (its 1000/64/17
case plans 128-row node tiles, which run here on Hopper)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade import cascade_node_kernel_name
from paged_backend.kernels.cascade import SM90_TAIL_GROUP, runs_tails, tails_sm90_view
from paged_backend.kernels.dispatch import SM90_TRITON, num_sms, triton_release
from tests.paged_inputs import make_cache, make_fp8_cache, misaligned, of_fused_rows, poison_outside
from tests.reference import assert_close_state, decode_reference
from tests.test_cascade import KEEP_ALL
from tests.test_cascade_plan import fused_expected

# fp8 plans as the engine makes them, every shared block kept, with fused lists whatever the node GEMMs' size
FP8_FUSED = dataclasses.replace(KEEP_ALL, kv_elem_bytes=1, fp8_fused_flops=float("inf"))

hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
         and triton_release() in SM90_TRITON),
    reason=f"needs an sm_90 GPU (H100/H200) and a Triton release the Gluon kernels were checked on {SM90_TRITON}")
pytestmark = [pytest.mark.gpu, hopper]


def groups_inputs(prefixes, n, suffix, hq, hkv, d, bs, dtype, layout="nhd", system=0, seed=0):
    """``len(prefixes)`` groups of ``n`` requests; group ``g`` shares ``system`` tokens with every
    group and ``prefixes[g]`` more within itself; each request has ``suffix`` private tokens."""
    rng = np.random.default_rng(seed)
    sys_blocks = system // bs
    per = [-(-(system + p + suffix) // bs) for p in prefixes]
    shared = [sys_blocks + p // bs for p in prefixes]
    nb = sys_blocks + sum(s - sys_blocks + n * (c - s) for s, c in zip(shared, per)) + 4
    perm = iter(rng.permutation(nb).tolist())
    sys_ids = [next(perm) for _ in range(sys_blocks)]
    rows, lens = [], []
    for g, p in enumerate(prefixes):
        own = sys_ids + [next(perm) for _ in range(shared[g] - sys_blocks)]
        for _ in range(n):
            rows.append(own + [next(perm) for _ in range(per[g] - shared[g])])
            lens.append(system + p + suffix)
    cols = max(map(len, rows))
    table = np.zeros((len(rows), cols), np.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    order = rng.permutation(len(rows))
    table, lens = np.ascontiguousarray(table[order]), np.asarray(lens, np.int64)[order]
    k, v = make_cache(nb, bs, hkv, d, dtype, device="cuda", layout=layout)
    q = torch.randn(len(rows), hq, d, device="cuda").to(dtype)
    return q, k, v, table, lens


def run_case(q, k, v, table, lens, bs, tails="fused", **plan_kw):
    """``tails``: "fused" - the Hopper kernel runs the tails too, where the plan has its lists (see
    tests/test_cascade_plan.py ``fused_expected``); "decode" - the plan's lists are dropped and the
    decode kernel runs the tails."""
    hq, hkv, d = q.shape[1], k.shape[2], q.shape[2]
    bt = torch.from_numpy(table).cuda()
    sl = torch.from_numpy(lens.astype(np.int32)).cuda()
    cplan = pb.plan_cascade(table, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cuda",
                            cost=KEEP_ALL, block_table_device=bt, **plan_kw)
    assert ("fused_prog_ptr" in cplan.views) == fused_expected(cplan, bs)
    if tails == "decode":
        cplan.views.pop("fused_prog_ptr", None)
    want = "sm90+tails" if "fused_prog_ptr" in cplan.views and hq // hkv <= SM90_TAIL_GROUP else "sm90"
    assert not cplan.is_flat and cascade_node_kernel_name(q, k, v, cplan) == want, cplan.block_m
    out, lse = pb.cascade_decode(q, k, v, cplan)
    ref_o, ref_l = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu())
    assert_close_state(out, lse, ref_o, ref_l, q.dtype)
    return out, lse, cplan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
@pytest.mark.parametrize("case", [
    dict(prefixes=[2000], n=32, suffix=37, hq=32, hkv=8, d=128, bs=16),       # one node, 128 rows
    dict(prefixes=[1024, 400, 3000], n=16, suffix=5, hq=32, hkv=4, d=128, bs=32, system=512),  # two levels, group 8
    dict(prefixes=[777 // 16 * 16], n=64, suffix=16, hq=16, hkv=8, d=64, bs=16),  # group 2, d 64
    dict(prefixes=[4096], n=40, suffix=100, hq=32, hkv=8, d=128, bs=64),      # 40 members: a partial row block
    dict(prefixes=[1008], n=16, suffix=20, hq=32, hkv=2, d=128, bs=16),  # group 16: the tails on the decode kernel
])
@pytest.mark.parametrize("tails", ["fused", "decode"])
def test_against_fp64(case, layout, dtype, tails):
    case = dict(case)
    bs = case["bs"]
    q, k, v, table, lens = groups_inputs(case.pop("prefixes"), case.pop("n"), case.pop("suffix"), case.pop("hq"),
                                         case.pop("hkv"), case.pop("d"), case.pop("bs"), dtype, layout, **case)
    run_case(q, k, v, table, lens, bs, tails)


@pytest.mark.parametrize("kv_dtype, dtype", [(torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float16)],
                         ids=["e4m3-bf16", "e5m2-fp16"])
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
@pytest.mark.parametrize("case", [
    dict(prefixes=[1024, 400, 3000], n=16, suffix=5, hq=32, hkv=4, d=128, bs=32, system=512),  # two levels, group 8
    dict(prefixes=[2048], n=48, suffix=100, hq=32, hkv=8, d=128, bs=16),      # 48 members: a partial row block
    dict(prefixes=[777 // 16 * 16], n=64, suffix=16, hq=16, hkv=8, d=64, bs=16),  # group 2, d 64
])
@pytest.mark.parametrize("tails", ["fused", "decode"])
def test_fp8_cache_nodes(case, layout, kv_dtype, dtype, tails):
    """fp8 caches, planned as the engine plans them (1-byte values): the node pieces of plans with 128-row tiles
    on the Hopper kernel (converter warps make its fp16 tiles; 9 programs, so nodes are cut into pieces too), the
    tails beside them in the same kernel where the plan has fused lists ("fused": the cost model's FLOPs bound on
    them lifted), else (the lists dropped: "decode") on the Hopper decode kernel launched beside it (three
    programs an SM) - against fp64 on the dequantized cache; the same bits twice."""
    case = dict(case)
    bs, hkv, d = case["bs"], case["hkv"], case["d"]
    q, k, v, table, lens = groups_inputs(case.pop("prefixes"), case.pop("n"), case.pop("suffix"), case.pop("hq"),
                                         case.pop("hkv"), case.pop("d"), case.pop("bs"), dtype, layout, **case)
    k, v = make_fp8_cache(k.shape[0], bs, hkv, d, kv_dtype, 0.05, 0.02, device="cuda", layout=layout)
    bt, sl = torch.from_numpy(table).cuda(), torch.from_numpy(lens.astype(np.int32)).cuda()
    cplan = pb.plan_cascade(table, lens, num_q_heads=q.shape[1], num_kv_heads=hkv, head_dim=d, block_size=bs,
                            device="cuda", cost=FP8_FUSED, block_table_device=bt, node_programs=9)
    assert not cplan.is_flat and cplan.block_m == 128
    assert ("fused_prog_ptr" in cplan.views) == fused_expected(cplan, bs)
    if tails == "decode":
        cplan.views.pop("fused_prog_ptr", None)
    fused = "fused_prog_ptr" in cplan.views and q.shape[1] // hkv <= SM90_TAIL_GROUP
    scales = (torch.tensor([0.05]), torch.tensor([0.02]))
    assert cascade_node_kernel_name(q, k, v, cplan, scales=scales) == ("sm90+tails" if fused else "sm90")
    if not fused:
        assert tails_sm90_view(q, k, v, cplan) is not None and cplan.leaf_programs == 3 * num_sms(q.device)
    out, lse = pb.cascade_decode(q, k, v, cplan, k_scale=0.05, v_scale=0.02)
    ref = decode_reference(q.cpu(), k.cpu().float() * 0.05, v.cpu().float() * 0.02, bt.cpu(), sl.cpu())
    assert_close_state(out, lse, *ref, dtype)
    again = pb.cascade_decode(q, k, v, cplan, k_scale=0.05, v_scale=0.02)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


def test_fp8_fused_one_tile_tails_repeatable():
    """fp8 cascade with the tails inside the node kernel, each tail one masked tile beside a 32K-key node (the
    tails' loader runs pieces ahead of its consumer while the node GEMMs hold the SM): the same bits as the plan's
    tails on the decode kernel, call after call. (A query box released before its loads had read it gave wrong
    states to 2-57 of the 512 tail pieces a call: results/sweeps/cascade_fp8_sm90_h200.log section 7.)"""
    q, k, v, table, lens = groups_inputs([32768], 64, 32, 32, 8, 128, 16, torch.bfloat16)
    k, v = make_fp8_cache(k.shape[0], 16, 8, 128, torch.float8_e4m3fn, 0.05, 0.02, device="cuda")
    bt = torch.from_numpy(table).cuda()
    cplan = pb.plan_cascade(table, lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                            cost=FP8_FUSED, block_table_device=bt)
    scales = (torch.tensor([0.05]), torch.tensor([0.02]))
    assert cascade_node_kernel_name(q, k, v, cplan, scales=scales) == "sm90+tails"
    runs = [pb.cascade_decode(q, k, v, cplan, k_scale=0.05, v_scale=0.02) for _ in range(6)]
    cplan.views.pop("fused_prog_ptr")
    cplan.launches.clear()
    assert cascade_node_kernel_name(q, k, v, cplan, scales=scales) == "sm90"
    ref = pb.cascade_decode(q, k, v, cplan, k_scale=0.05, v_scale=0.02)
    for out, lse in runs:
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def test_cut_pieces_deterministic_and_poisoned():
    """Few programs over a long node: its range is cut into pieces (stream-K), each a partial state;
    slots outside every request hold NaN; two runs are bitwise equal."""
    q, k, v, table, lens = groups_inputs([8192], 32, 3, 32, 8, 128, 16, torch.bfloat16)
    bt, sl = torch.from_numpy(table).cuda(), torch.from_numpy(lens.astype(np.int32)).cuda()
    poison_outside(k, v, bt, sl, float("nan"))
    first = run_case(q, k, v, table, lens, 16, node_programs=7)
    assert first[2].num_node_pieces > 8 and "fused_prog_ptr" in first[2].views  # 8 KV heads, cut; tails fused
    again = pb.cascade_decode(q, k, v, first[2])
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def fused_plan(table, lens, bt):
    """``plan_cascade`` of bench_cascade's shape (Hq 32, Hkv 8, D 128, pages of 16), every shared block kept."""
    return pb.plan_cascade(table, lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                           cost=KEEP_ALL, block_table_device=bt)


@pytest.mark.parametrize("softcap", [30.0, 2.0])
def test_softcap(softcap):
    """Soft-capped scores (Gemma 2): the Hopper kernel runs node and tail pieces, capping each score
    with ``tanh.approx`` as the portable kernels do for half-precision inputs."""
    q, k, v, table, lens = groups_inputs([2000], 32, 300, 32, 8, 128, 16, torch.bfloat16)
    bt, sl = torch.from_numpy(table).cuda(), torch.from_numpy(lens.astype(np.int32)).cuda()
    cplan = fused_plan(table, lens, bt)
    assert "fused_prog_ptr" in cplan.views and cascade_node_kernel_name(q, k, v, cplan, softcap=softcap) == "sm90+tails"
    out, lse = pb.cascade_decode(q, k, v, cplan, softcap=softcap)
    ref_o, ref_l = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu(), softcap=softcap)
    assert_close_state(out, lse, ref_o, ref_l, q.dtype)


@pytest.mark.parametrize("tails", ["fused", "decode"])
def test_fp8_softcap(tails):
    """Soft-capped scores over an fp8 cache: the node pieces on the Hopper kernel (converter warps), the tails
    inside it ("fused") or on the Hopper decode kernel ("decode") - against fp64 on the dequantized cache."""
    q, k, v, table, lens = groups_inputs([2048], 32, 300, 32, 8, 128, 16, torch.bfloat16)
    k, v = make_fp8_cache(k.shape[0], 16, 8, 128, torch.float8_e4m3fn, 0.05, 0.02, device="cuda")
    bt, sl = torch.from_numpy(table).cuda(), torch.from_numpy(lens.astype(np.int32)).cuda()
    cplan = pb.plan_cascade(table, lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                            cost=FP8_FUSED, block_table_device=bt)
    if tails == "decode":
        cplan.views.pop("fused_prog_ptr")
    scales = (torch.tensor([0.05]), torch.tensor([0.02]))
    want = "sm90+tails" if tails == "fused" else "sm90"
    assert cascade_node_kernel_name(q, k, v, cplan, softcap=30.0, scales=scales) == want
    out, lse = pb.cascade_decode(q, k, v, cplan, softcap=30.0, k_scale=0.05, v_scale=0.02)
    ref = decode_reference(q.cpu(), k.cpu().float() * 0.05, v.cpu().float() * 0.02, bt.cpu(), sl.cpu(), softcap=30.0)
    assert_close_state(out, lse, *ref, q.dtype)


def test_fused_plan_uncovered_call_runs_portable():
    """A plan with fused lists whose call the Hopper kernel does not cover (fp32: it reads fp16/bf16
    caches): the portable node kernel and the decode kernel run it, the tails on the decode programs'
    runs of the pieces cut over the node programs."""
    q, k, v, table, lens = groups_inputs([2000], 32, 300, 32, 8, 128, 16, torch.float32)
    bt, sl = torch.from_numpy(table).cuda(), torch.from_numpy(lens.astype(np.int32)).cuda()
    cplan = fused_plan(table, lens, bt)
    assert "fused_prog_ptr" in cplan.views and cascade_node_kernel_name(q, k, v, cplan) == "portable"
    out, lse = pb.cascade_decode(q, k, v, cplan)
    ref_o, ref_l = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu())
    assert_close_state(out, lse, ref_o, ref_l, q.dtype)


def test_replays_with_new_addresses():
    """Later calls replay the plan's launches: the Hopper kernel's with the TMA maps kept per address
    (kernels/launch.py ``_TmaLaunch``: the C launcher called directly on the Triton release the Gluon
    kernels run on). New caches and queries, then the first ones again:
    each replay equals the first call of a fresh plan bit for bit."""
    from paged_backend.kernels.launch import DescriptorRelaunch
    q, k, v, table, lens = groups_inputs([2000], 32, 37, 32, 8, 128, 16, torch.bfloat16)
    out, lse, cplan = run_case(q, k, v, table, lens, 16)
    replays = [r for rs in cplan.launches.values() for r in rs if isinstance(r, DescriptorRelaunch)]
    assert len(replays) == 1 and replays[0].tma is not None
    k2, v2, q2 = k.flip(0).contiguous(), v.flip(0).contiguous(), q.flip(0).contiguous()
    for args in ((q2, k2, v2), (q, k, v), (q2, k2, v2)):
        fresh = pb.plan_cascade(table, lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                                device="cuda", cost=KEEP_ALL)
        want = pb.cascade_decode(*args, fresh)
        got = pb.cascade_decode(*args, cplan)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(replays[0].tma.maps) == 6  # (k, v and the tails' q) at two addresses


@pytest.mark.parametrize("view", ["of_qkv", "unaligned"])
def test_query_views(view):
    """The queries as a view of a fused QKV projection's rows (TMA reads them: the Hopper kernel and its tails),
    and at an address TMA cannot read (the Hopper kernel's node pieces, which read them by pointer, and the
    portable decode kernel's tails); both exact."""
    q, k, v, table, lens = groups_inputs([2000], 32, 37, 32, 8, 128, 16, torch.bfloat16)
    qv = of_fused_rows(q, 2 * 8) if view == "of_qkv" else misaligned(q)
    bt, sl = torch.from_numpy(table).cuda(), torch.from_numpy(lens.astype(np.int32)).cuda()
    cplan = pb.plan_cascade(table, lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                            cost=KEEP_ALL, block_table_device=bt)
    assert runs_tails(cplan, qv) == ("fused_prog_ptr" in cplan.views and view == "of_qkv")
    assert cascade_node_kernel_name(qv, k, v, cplan) == ("sm90+tails" if runs_tails(cplan, qv) else "sm90")
    out, lse = pb.cascade_decode(qv, k, v, cplan)
    assert_close_state(out, lse, *decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu()), q.dtype)


def test_a_forest_that_loses_requests_replays_the_first_launches():
    """Two prompts' samples planned into one arena, then one prompt's samples finished (padding rows of
    length 0, as in the engine's padded batches): fewer node pieces, the same launch key, and the first
    plan's launches - as the CUDA graph captured with it replays them - give the new step's attention
    (against fp64), bit for bit the new plan's own call. The Hopper kernel reads the kinds of its
    pieces from its lists (tail pieces as ``-1 - j``), not a node piece count fixed at launch."""
    from paged_backend.cascade import CascadeArena
    q, k, v, table, lens = groups_inputs([2000, 1024], 32, 300, 32, 8, 128, 16, torch.bfloat16)
    bt = torch.from_numpy(table).cuda()
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda", cost=KEEP_ALL,
              block_table_device=bt)
    arena = CascadeArena.grown_for(pb.plan_cascade(table, lens, **kw))
    first = pb.plan_cascade(table, lens, arena=arena, **kw)
    assert "fused_prog_ptr" in first.views and cascade_node_kernel_name(q, k, v, first) == "sm90+tails"
    pb.cascade_decode(q, k, v, first)  # (its launches made)
    done = lens == 1024 + 300  # the second prompt's samples finish; the first's decode one more token
    table, lens = table.copy(), lens.copy()
    table[done], lens[done] = 0, 0
    lens[~done] += 1
    bt.copy_(torch.from_numpy(table))
    plan = pb.plan_cascade(table, lens, arena=arena, **kw)
    assert plan.arena is arena and 0 < plan.num_node_pieces < first.num_node_pieces
    assert plan.launch_key() == first.launch_key()
    out, lse = pb.cascade_decode(q, k, v, first)
    ref_o, ref_l = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), torch.from_numpy(lens.astype(np.int32)))
    assert_close_state(out, lse, ref_o, ref_l, q.dtype)
    own = pb.cascade_decode(q, k, v, plan)
    assert torch.equal(out, own[0]) and torch.equal(lse, own[1])
