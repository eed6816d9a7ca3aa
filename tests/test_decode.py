"""Paged decode against the dense fp64 reference (torch path, or Triton under TRITON_INTERPRET=1)."""
import zlib

import pytest
import torch

import paged_backend as pb
from paged_backend.kernels.dispatch import INTERPRET
from paged_inputs import make_decode_inputs
from reference import assert_close_state, decode_reference

pytestmark = pytest.mark.kernel

DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


def run_case(seq_lens, hq, hkv, d, bs, dtype, layout="nhd", q_scale=1.0, plan_mode=None, num_programs=None,
             scale=None, tol=None):
    # A stable seed per case (hash() of strings changes from one process to the next).
    torch.manual_seed(zlib.crc32(repr((tuple(seq_lens), hq, hkv, d, bs, str(dtype), layout)).encode()))
    q, k, v, bt, sl = make_decode_inputs(seq_lens, hq, hkv, d, bs, dtype, layout=layout, q_scale=q_scale)
    plan = None
    if plan_mode is not None:
        plan = pb.plan_decode(sl, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cpu",
                              mode=plan_mode, num_programs=num_programs, block_n=16)
    out, lse = pb.paged_decode(q, k, v, bt, sl, scale=scale, plan=plan)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    ref_o, ref_lse = decode_reference(q, k, v, bt, sl, scale=scale)
    assert_close_state(out, lse, ref_o, ref_lse, dtype, tol=tol)
    return out, lse


@pytest.mark.parametrize("bs", [1, 16, 64, 256])
@pytest.mark.parametrize("n_off", [-1, 0, 1])
def test_lengths_around_block_size(bs, n_off):
    n = max(1, bs + n_off)
    run_case([n, 1, 2 * bs + n_off + 1], 8, 2, 64, bs, torch.float32)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2), (32, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_and_dtypes(hq, hkv, dtype):
    run_case([1, 70, 33], hq, hkv, 64, 16, dtype)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_head_dims(d):
    run_case([5, 40], 4, 2, d, 8, torch.float16)


def test_ragged_with_empty_and_long():
    out, lse = run_case([0, 300, 1, 0, 17], 4, 1, 64, 16, torch.float32)
    assert torch.all(out[0] == 0) and torch.all(out[3] == 0)
    assert torch.all(lse[0] == float("-inf")) and torch.all(lse[3] == float("-inf"))


@pytest.mark.parametrize("layout", ["vllm"])
def test_vllm_strided_cache_views(layout):
    run_case([40, 9], 8, 2, 128, 16, torch.float16, layout=layout)


def test_huge_logits_stay_finite():
    # Scores of magnitude ~1e3 carry fp32 rounding of ~1e3 * 2^-24 = 6e-5 into the softmax weights.
    run_case([200, 3], 8, 2, 64, 16, torch.float32, q_scale=300.0, tol=1e-4)


def test_custom_scale():
    run_case([50], 4, 2, 64, 16, torch.float32, scale=0.3)


def test_non_contiguous_q():
    q, k, v, bt, sl = make_decode_inputs([30, 7], 8, 2, 64, 16, torch.float32)
    q_wide = torch.randn(2, 8, 128)
    q_view = q_wide[:, :, ::2]
    out, lse = pb.paged_decode(q_view, k, v, bt, sl)
    ref_o, ref_lse = decode_reference(q_view.contiguous(), k, v, bt, sl)
    assert_close_state(out, lse, ref_o, ref_lse, torch.float32)


@pytest.mark.parametrize("mode", ["stream_k", "split"])
@pytest.mark.parametrize("num_programs", [1, 3, 7, 64])
def test_any_plan_is_exact(mode, num_programs):
    run_case([1, 130, 0, 64, 65], 8, 2, 64, 4, torch.float32, plan_mode=mode, num_programs=num_programs)


def test_whole_segments_take_long_tiles():
    """A plan that cuts no segment runs 128-token kernel tiles in 2 stages over its 16-token units:
    exact for lengths that are not multiples of the tile; a split plan keeps its units as tiles."""
    lens = [300, 0, 129, 1, 257, 128]
    q, k, v, bt, sl = make_decode_inputs(lens, 8, 2, 64, 16, torch.float32)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu", block_n=16)
    plan = pb.plan_decode(sl, **kw, num_programs=1)
    assert plan.whole and plan.kernel_tile == (128, 2)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl), torch.float32)
    split = pb.plan_decode(sl, **kw, num_programs=64)
    assert not split.whole and split.kernel_tile == (16, 3)
    assert plan.update(sl + 1).whole and plan.num_pieces == 12  # a decode step: still whole segments
    wide = pb.plan_decode(sl, **{**kw, "head_dim": 256}, num_programs=1)
    assert wide.whole and wide.kernel_tile == (16, 3)  # D = 256: shared memory holds no longer tiles


def test_many_pieces_per_segment():
    # 63 pieces per segment: the fix-up merges them in several chunks.
    run_case([1000, 2], 4, 1, 64, 16, torch.float32, plan_mode="stream_k", num_programs=100)


@pytest.mark.parametrize("hq,d", [(1, 128), (2, 128), (2, 80)])
def test_fold_splits_columns_when_rows_are_few(hq, d):
    # B * Hq rows under the SM count (4 in the interpreter): 2 or 4 programs fold a row's columns
    # (a ragged last block for D = 80); 50 pieces take several rounds of loads per list.
    run_case([800], hq, 1, d, 16, torch.float32, plan_mode="stream_k", num_programs=50)


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="runs the fold kernel itself")
@pytest.mark.parametrize("requests", [1, 8])
@pytest.mark.parametrize("sinks", [False, True])
def test_fold_of_slot_lists(requests, sinks):
    # The cascade's form of the fold (lists of slot indices, one a (request, kv head)), against logsumexp in
    # fp64, with and without sinks: 2 or 16 lists (under or over the SM count, 4 in the interpreter), a
    # group of 6, lists of 0, 1, 3 and 11 states (11: rounds of the 4 loaded at once), an empty state (lse
    # -inf) among them.
    from paged_backend.kernels.decode import fold_states
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    hkv, group, d = 2, 6, 32
    lens = [(0, 1, 3, 11)[s % 4] for s in range(requests * hkv)]
    gen = torch.Generator().manual_seed(7)
    po = torch.randn(sum(lens) + 5, group, d, generator=gen)
    plse = torch.randn(sum(lens) + 5, group, generator=gen) * 3
    slots = torch.randperm(po.shape[0], generator=gen)[:sum(lens)]
    plse[slots[-1], 1] = float("-inf")
    lists = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    sink = torch.randn(hkv * group, generator=gen) if sinks else None
    out = torch.empty(requests, hkv * group, d, device=dev)
    lse = torch.empty(requests, hkv * group, device=dev)
    fold_states(lists.int().to(dev), po.to(dev), plse.to(dev), out, lse, hkv, False, slots=slots.int().to(dev),
                max_len=4, sinks=None if sink is None else sink.to(dev))
    for s in range(requests * hkv):
        b, heads = s // hkv, slice(s % hkv * group, (s % hkv + 1) * group)
        idx = slots[lists[s]:lists[s + 1]]
        ls, os_ = plse[idx].double(), po[idx].double()  # [n, G], [n, G, D]
        if sinks:  # a key of logit sink and value 0
            ls = torch.cat([ls, sink[heads].double()[None]])
            os_ = torch.cat([os_, torch.zeros(1, group, d, dtype=torch.float64)])
        ref_lse = torch.logsumexp(ls, 0) if len(ls) else torch.full((group,), float("-inf"), dtype=torch.float64)
        w = torch.exp(ls - ref_lse.clamp(min=-1e30))
        ref_o = (w[:, :, None] * os_).sum(0)
        assert torch.allclose(out[b, heads].cpu().double(), ref_o, atol=1e-5, rtol=1e-5), s
        assert torch.allclose(lse[b, heads].cpu().double(), ref_lse, atol=1e-5, rtol=1e-5), s


def test_ragged_mix_one_token_next_to_long():
    run_case([1, 600, 1, 1], 4, 2, 64, 16, torch.float32, plan_mode="stream_k", num_programs=5)


def test_deterministic_bits():
    q, k, v, bt, sl = make_decode_inputs([90, 33, 129], 8, 2, 64, 16, torch.float32)
    plan = pb.plan_decode(sl, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
                          num_programs=5, block_n=16)
    first = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    for _ in range(2):
        again = pb.paged_decode(q, k, v, bt, sl, plan=plan)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_return_lse_false():
    q, k, v, bt, sl = make_decode_inputs([12], 4, 2, 64, 16, torch.float32)
    out = pb.paged_decode(q, k, v, bt, sl, return_lse=False)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


def test_caller_outputs():
    """out/lse_out are written in place and returned, with the same bits as new outputs; views of
    one buffer work (as TreeMerger's send views)."""
    q, k, v, bt, sl = make_decode_inputs([12, 0, 70], 4, 2, 64, 16, torch.float32)
    want_o, want_lse = pb.paged_decode(q, k, v, bt, sl)
    buf = torch.full((3 * 4 * (1 + 64),), float("nan"))
    out, lse_out = buf[12:].view(3, 4, 64), buf[:12].view(3, 4)
    o, lse = pb.paged_decode(q, k, v, bt, sl, out=out, lse_out=lse_out)
    assert o is out and lse is lse_out
    assert torch.equal(out, want_o) and torch.equal(lse_out, want_lse)
    lse_out.fill_(0.0)
    assert pb.paged_decode(q, k, v, bt, sl, return_lse=False, lse_out=lse_out) is not None
    assert torch.equal(lse_out, want_lse)


def test_plan_update_reuses_buffers():
    q, k, v, bt, sl = make_decode_inputs([100, 100], 4, 2, 64, 16, torch.float32)
    plan = pb.plan_decode([100, 100], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
                          num_programs=3)
    buf = plan.buffers.data_ptr()
    new = torch.tensor([7, 93], dtype=torch.int32)
    plan.update(new)
    assert plan.buffers.data_ptr() == buf
    out, lse = pb.paged_decode(q, k, v, bt, new, plan=plan)
    ref_o, ref_lse = decode_reference(q, k, v, bt, new)
    assert_close_state(out, lse, ref_o, ref_lse, torch.float32)


@pytest.mark.skipif(INTERPRET, reason="the interpreter's kernels always take the normal path")
def test_stream_k_and_split_calls_do_the_same_host_work(monkeypatch):
    """Issue 36 item 5 (eager B1x8K stream-K measured 2x split): a call with either plan, once its
    launches are kept, is the same two direct launcher calls (decode, fold; only the decode grid
    differs) and nothing else of Triton's: no launch() key, no JITFunction.run, no torch.empty in
    decode_triton. The direct path is switched on without a GPU: the kernels' normal launches and
    their compiled launcher only record their calls."""
    from types import SimpleNamespace

    from paged_backend.kernels import decode as kernels_decode, launch

    seen = []
    for kernel in (kernels_decode._decode_kernel, kernels_decode._fold_states_kernel):
        name = kernel.__name__
        compiled = SimpleNamespace(function=name, packed_metadata="packed",
                                   run=lambda *a, name=name: seen.append(("direct", name, a[:3])))
        monkeypatch.setattr(kernel, "run", lambda *a, grid, warmup, name=name, compiled=compiled, **kw:
                            seen.append(("normal", name, grid)) or compiled)
    monkeypatch.setattr(launch, "DISABLED_BY", None)
    monkeypatch.setattr(launch, "_device", lambda: 0)
    monkeypatch.setattr(launch, "_stream", lambda device: "stream")
    monkeypatch.setattr(launch, "_entries", {})
    keyed = []
    monkeypatch.setattr(kernels_decode, "launch", lambda *a, _launch=launch.launch, **kw:
                        keyed.append(a[0]) or _launch(*a, **kw))
    lens = [8192]  # B1x8K on a 132-SM GPU: 264 programs
    q, k, v, bt, sl = make_decode_inputs(lens, 32, 8, 128, 16, torch.float32)
    out, lse = torch.zeros(1, 32, 128), torch.zeros(1, 32)
    per_call = {}
    for mode in ("stream_k", "split"):
        plan = pb.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cpu",
                              mode=mode, num_programs=264)
        kernels_decode.decode_triton(q, k, v, bt, sl, plan, 128 ** -0.5, out, lse)  # keeps its launches
        seen.clear(), keyed.clear()
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", lambda *a, **kw: pytest.fail("decode_triton allocated"))
            for _ in range(3):
                kernels_decode.decode_triton(q, k, v, bt, sl, plan, 128 ** -0.5, out, lse)
        assert not keyed and len(seen) == 6 and all(s[0] == "direct" for s in seen)
        per_call[mode] = seen[:2]
        assert seen[2:4] == seen[:2] == seen[4:]
    grids = {mode: [s[2] for s in calls] for mode, calls in per_call.items()}
    assert grids == {"stream_k": [(264, 1, 1), (8, 4, 1)], "split": [(264 + 8, 1, 1), (8, 4, 1)]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["stream_k", "split", None])
def test_gpu_large(dtype, mode):
    lens = [1, 16, 17, 5000, 70000, 0, 333]
    q, k, v, bt, sl = make_decode_inputs(lens, 32, 8, 128, 16, dtype, device="cuda", layout="vllm")
    plan = None
    if mode is not None:
        plan = pb.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                              mode=mode)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    ref_o, ref_lse = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu())
    assert_close_state(out, lse, ref_o, ref_lse, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_whole_segments_long_tiles():
    """64 requests of 4033-4096 tokens (64 tiles each, not multiples of 128 tokens): the default plan
    cuts no segment, so the kernel runs 128-token tiles."""
    lens = [4096 - i % 64 for i in range(64)]
    q, k, v, bt, sl = make_decode_inputs(lens, 32, 8, 128, 16, torch.bfloat16, device="cuda", layout="vllm")
    plan = pb.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda")
    assert plan.whole and plan.kernel_tile == (128, 2)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    ref_o, ref_lse = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu())
    assert_close_state(out, lse, ref_o, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_deterministic_under_stream_k():
    lens = [70000, 3, 20000]
    q, k, v, bt, sl = make_decode_inputs(lens, 32, 8, 128, 16, torch.bfloat16, device="cuda")
    plan = pb.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda")
    first = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    for _ in range(20):
        again = pb.paged_decode(q, k, v, bt, sl, plan=plan)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_updates_while_the_gpu_is_busy():
    """The host plans several steps ahead of a busy GPU: each step's copy must still read that
    step's partition (no staging array rewritten before its copy ran)."""
    q, k, v, bt, sl = make_decode_inputs([40000] * 4, 32, 8, 128, 16, torch.bfloat16, device="cuda")
    steps = ([40000, 17, 300, 5000], [1, 39000, 2, 0], [20000, 20000, 1, 40000], [5, 6, 7, 8])
    plan = pb.plan_decode(steps[0], num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda")
    pb.paged_decode(q, k, v, bt, sl, plan=plan)  # compiled before the GPU is kept busy
    torch.cuda.synchronize()
    lens_dev = [torch.tensor(n, dtype=torch.int32, device="cuda") for n in steps]
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every step below is queued behind it
    outs = []
    for n, d in zip(steps, lens_dev):
        plan.update(n)
        outs.append(pb.paged_decode(q, k, v, bt, d, plan=plan))
    for (out, lse), d in zip(outs, lens_dev):
        ref_o, ref_lse = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), d.cpu())
        assert_close_state(out, lse, ref_o, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replays_with_new_lengths():
    q, k, v, bt, sl = make_decode_inputs([70000] * 4, 32, 8, 128, 16, torch.bfloat16, device="cuda")
    lens = [5000, 17, 300, 70000]
    sl.copy_(torch.tensor(lens, dtype=torch.int32))
    plan = pb.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pb.paged_decode(q, k, v, bt, sl, plan=plan)  # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    for new in ([70000, 1, 4000, 0], [1, 1, 1, 1], [5000, 17, 300, 70000]):
        sl.copy_(torch.tensor(new, dtype=torch.int32))
        plan.update(new)
        graph.replay()
        ref_o, ref_lse = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu())
        assert_close_state(out, lse, ref_o, ref_lse, torch.bfloat16)
