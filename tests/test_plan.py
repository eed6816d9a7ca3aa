"""Properties of the host decode partition (no kernels run here)."""
from bisect import bisect_left
from itertools import accumulate

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_backend as pb
from paged_backend.decode_plan import NO_SPLIT_SLACK


def host_arrays(plan):
    buf = plan.buffers.cpu().numpy()
    n = plan.max_pieces * 5
    work = buf[:n].reshape(-1, 5)
    prog_ptr = buf[n:n + plan.num_programs + 1]
    seg_ptr = buf[n + plan.num_programs + 1:]
    return work[:plan.num_pieces], prog_ptr, seg_ptr


def make(lens, hkv=2, mode="stream_k", g=8, d=64, block_n=None):
    return pb.plan_decode(np.asarray(lens), num_q_heads=2 * hkv, num_kv_heads=hkv, head_dim=d, block_size=16,
                          device="cpu", mode=mode, num_programs=g, block_n=block_n)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(lens=st.lists(st.integers(0, 3000), min_size=1, max_size=12), hkv=st.sampled_from([1, 2, 8]),
       mode=st.sampled_from(["stream_k", "split"]), g=st.integers(1, 300))
def test_every_token_covered_exactly_once(lens, hkv, mode, g):
    plan = make(lens, hkv, mode, g, block_n=16)
    work, prog_ptr, seg_ptr = host_arrays(plan)
    bn = plan.block_n
    assert prog_ptr[0] == 0 and prog_ptr[-1] == plan.num_pieces and np.all(np.diff(prog_ptr) >= 0)
    assert seg_ptr[0] == 0 and seg_ptr[-1] == plan.num_pieces and np.all(np.diff(seg_ptr) >= 0)
    for s in range(len(lens) * hkv):
        b, h = divmod(s, hkv)
        pieces = work[seg_ptr[s]:seg_ptr[s + 1]]
        assert np.all(pieces[:, 0] == b) and np.all(pieces[:, 1] == h)
        # Pieces of a segment tile [0, len) in order, without gaps or overlaps, at tile boundaries.
        edges = np.concatenate([[0], pieces[:, 3]]) if len(pieces) else np.array([0])
        assert np.array_equal(pieces[:, 2], edges[:-1])
        assert edges[-1] == lens[b]
        assert np.all(pieces[:, 2] % bn == 0)
        if lens[b] == 0:  # one empty piece, so the output is still written (o = 0, lse = -inf)
            assert len(pieces) == 1 and pieces[0, 3] == 0
        else:
            assert np.all(pieces[:, 3] > pieces[:, 2])
        # One piece writes the output; several write distinct workspace slots reduced in order.
        if len(pieces) == 1:
            assert pieces[0, 4] == -1
        else:
            assert np.array_equal(pieces[:, 4], np.arange(seg_ptr[s], seg_ptr[s + 1]))
    assert plan.num_pieces <= plan.max_pieces


@settings(max_examples=100, deadline=None, derandomize=True)
@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=10), g=st.integers(1, 200))
def test_stream_k_runs_differ_by_at_most_one_unit(lens, g):
    plan = make(lens, 2, "stream_k", g, block_n=32)
    work, prog_ptr, _ = host_arrays(plan)
    units = -(-(work[:, 3] - work[:, 2]) // plan.block_n)
    per_prog = np.array([units[prog_ptr[i]:prog_ptr[i + 1]].sum() for i in range(g)])
    assert per_prog.sum() == sum(-(-n // plan.block_n) for n in lens) * 2
    whole_segments = all(work[prog_ptr[i]:prog_ptr[i + 1], 4].max(initial=-1) == -1 for i in range(g))
    if not whole_segments:  # even cut: equal runs
        assert per_prog.max() - per_prog.min() <= 1


def reference_partition(lens, hkv, g, bn, mode):
    """The partition spelled out with Python loops -> (work rows, prog_ptr, seg_ptr)."""
    seg_units = [max(-(-n // bn), 1) for n in lens for _ in range(hkv)]
    starts = [0, *accumulate(seg_units)]
    total, n_seg = starts[-1], len(seg_units)
    if mode == "split":  # each segment in chunks of equal units, ceil(G / S) chunks or fewer
        chunks = max(1, -(-g // max(1, n_seg)))
        bounds = [x for s, u in enumerate(seg_units) for x in range(starts[s], starts[s + 1], -(-u // chunks))]
        bounds.append(total)
        num_programs = g + n_seg
    elif n_seg >= g and -(-n_seg // g) * max(seg_units) <= NO_SPLIT_SLACK * total / g:
        bounds, num_programs = [starts[i * n_seg // g] for i in range(g + 1)], g  # whole segments
    else:
        bounds, num_programs = [i * total // g for i in range(g + 1)], g  # even cut
    work, seg_ptr, piece_starts = [], [0], []
    for s, u in enumerate(seg_units):
        b, h = divmod(s, hkv)
        edges = sorted({0, u} | {x - starts[s] for x in bounds if starts[s] < x < starts[s + 1]})
        for lo, hi in zip(edges, edges[1:]):
            work.append((b, h, lo * bn, min(hi * bn, lens[b]), len(work) if len(edges) > 2 else -1))
            piece_starts.append(starts[s] + lo)
        seg_ptr.append(len(work))
    prog_ptr = [bisect_left(piece_starts, x) for x in bounds]
    prog_ptr += [len(work)] * (num_programs + 1 - len(prog_ptr))
    return np.array(work, dtype=np.int64).reshape(-1, 5), prog_ptr, seg_ptr


@settings(max_examples=100, deadline=None, derandomize=True)
@given(lens=st.lists(st.integers(0, 3000), min_size=0, max_size=12), before=st.lists(st.integers(0, 3000), max_size=12),
       hkv=st.sampled_from([1, 2, 8]), mode=st.sampled_from(["stream_k", "split"]), g=st.integers(1, 300),
       block_n=st.sampled_from([16, 64]))
def test_partition_matches_reference(lens, before, hkv, mode, g, block_n):
    # A fresh plan, and one updated from other lengths (its buffers hold an older partition).
    before = (before + lens)[: len(lens)]
    for plan in (make(lens, hkv, mode, g, block_n=block_n), make(before, hkv, mode, g, block_n=block_n).update(lens)):
        work, prog_ptr, seg_ptr = host_arrays(plan)
        ref_work, ref_prog_ptr, ref_seg_ptr = reference_partition(lens, hkv, g, block_n, mode)
        assert np.array_equal(work, ref_work)
        assert prog_ptr.tolist() == ref_prog_ptr and seg_ptr.tolist() == ref_seg_ptr


def test_no_split_when_batch_fills_gpu():
    plan = make([4096] * 64, hkv=8, g=264)
    work, _, _ = host_arrays(plan)
    assert plan.num_pieces == 64 * 8 and np.all(work[:, 4] == -1)


def test_long_request_is_spread_over_all_programs():
    plan = make([32768], hkv=8, g=264, d=128)
    work, prog_ptr, _ = host_arrays(plan)
    assert np.all(np.diff(prog_ptr) >= 1)


def test_more_programs_than_units():
    plan = make([10, 0, 3], hkv=1, g=50)
    work, prog_ptr, seg_ptr = host_arrays(plan)
    assert plan.num_pieces == 3 and list(np.diff(seg_ptr)) == [1, 1, 1]
    assert list(work[:, 3]) == [10, 0, 3] and np.all(work[:, 4] == -1)


@pytest.mark.parametrize("bad,err,match", [
    (dict(seq_lens_cpu=[[1, 2]]), ValueError, "seq_lens_cpu"),
    (dict(seq_lens_cpu=[-1]), ValueError, "seq_lens_cpu"),
    (dict(seq_lens_cpu=[1.5]), TypeError, "seq_lens_cpu"),
    (dict(num_q_heads=6, num_kv_heads=4), ValueError, "heads"),
    (dict(head_dim=72), ValueError, "head_dim"),
    (dict(block_size=12), ValueError, "block_size"),
    (dict(block_size=512), ValueError, "block_size"),
    (dict(mode="ring"), ValueError, "mode"),
    (dict(num_programs=0), ValueError, "num_programs"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(block_n=48), ValueError, "block_n"),
    (dict(kv_dtype="fp8"), TypeError, "kv_dtype"),
])
def test_bad_arguments(bad, err, match):
    args = dict(seq_lens_cpu=[5, 6], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device="cpu")
    args.update(bad)
    seq = args.pop("seq_lens_cpu")
    with pytest.raises(err, match=match):
        pb.plan_decode(seq, **args)


@pytest.mark.parametrize("kw,per_sm", [
    (dict(kv_dtype=torch.float8_e4m3fn), 3), (dict(kv_dtype=torch.uint8), 3),  # (vLLM's fp8 spec: uint8)
    (dict(), 2), (dict(kv_dtype=torch.bfloat16), 2),
    (dict(kv_dtype=torch.float8_e5m2, window=128), 2),  # windows: the portable kernel
    (dict(kv_dtype=torch.float8_e4m3fn, num_q_heads=64, num_kv_heads=2), 2),  # group 32: the portable kernel
    (dict(kv_dtype=torch.float8_e4m3fn, block_size=8), 2),
])
def test_fp8_plans_take_three_programs_an_sm_where_the_hopper_kernel_runs_them(monkeypatch, kw, per_sm):
    from paged_backend import decode_plan
    monkeypatch.setattr(decode_plan, "use_sm90", lambda device: True)
    args = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cpu")
    plan = pb.plan_decode([300, 5000], **{**args, **kw})
    assert plan.num_programs == 4 * per_sm and plan.programs_an_sm == per_sm  # (4 "SMs" on the CPU)
    monkeypatch.setattr(decode_plan, "use_sm90", lambda device: False)  # elsewhere: always 2
    assert pb.plan_decode([300, 5000], **{**args, **kw}).num_programs == 8


def test_update_rejects_other_batch_size():
    plan = make([5, 6])
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        plan.update([5, 6, 7])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(start=st.lists(st.integers(0, 400), min_size=1, max_size=6), steps=st.integers(1, 150),
       mode=st.sampled_from(["stream_k", "split"]), g=st.integers(1, 40))
def test_update_over_decode_steps_equals_a_fresh_plan(start, steps, mode, g):
    # Decode steps add a token per request; most steps take update's incremental path.
    plan = make(start, 2, mode, g, block_n=16)
    lens = np.array(start)
    for step in range(steps):
        lens = lens + 1 if step % 37 else lens + np.arange(lens.size) * 7  # now and then a jump
        plan.update(lens)
        fresh = make(lens, 2, mode, g, block_n=16)
        for a, b in zip(host_arrays(plan), host_arrays(fresh)):
            assert np.array_equal(a, b)
