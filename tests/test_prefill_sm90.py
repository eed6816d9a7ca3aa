"""The Hopper prefill kernel (kernels/prefill_sm90.py) against the dense fp64 reference, on an sm_90 GPU.

Every case asserts that ``paged_prefill`` really dispatched to it (``prefill_kernel_name``), so the
file cannot pass on the portable kernel by accident; the calls it does not cover are asserted to fall
back. On CPU machines (CI), other GPUs and other Triton releases the file is skipped: the portable
kernel they run is what tests/test_prefill.py covers there.
"""
from __future__ import annotations

import pytest
import torch

import paged_backend as pb
from paged_backend.kernels.dispatch import SM90_TRITON, triton_release
from paged_backend.prefill import prefill_kernel_name
from tests.paged_inputs import pad_table, poison_outside
from tests.reference import assert_close_state, prefill_reference
from tests.test_prefill import device_reference, make_prefill_inputs

BF16, F16 = torch.bfloat16, torch.float16
hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
         and triton_release() in SM90_TRITON),
    reason=f"needs an sm_90 GPU (H100/H200) and a Triton release the Gluon kernel was checked on {SM90_TRITON}")
pytestmark = [pytest.mark.gpu, hopper]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def run_sm90(inputs, causal=True, **kw):
    q, k, v, bt, sl, qsl = inputs
    assert prefill_kernel_name(q, k, v) == "sm90"
    return pb.paged_prefill(q, k, v, bt, sl, qsl, causal=causal, **kw)


CASES = {  # q_lens, seq_lens, Hq, Hkv, D, BS
    "one prompt": ([1000], [1000], 32, 8, 128, 16),
    "chunks mid-page, decodes, empty": ([1, 17, 300, 129, 0], [50, 517, 300, 2000, 33], 32, 8, 128, 16),
    "d64 mha bs32": ([257, 64], [900, 64], 8, 8, 64, 32),
    "group 8 pages 256": ([700, 5], [1300, 260], 32, 4, 128, 256),
    "group 16 pages 64": ([333, 1], [1000, 64], 32, 2, 128, 64),
    "group 64": ([90, 2], [200, 130], 64, 1, 64, 16),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
@pytest.mark.parametrize("case", list(CASES))
def test_against_fp64(case, layout, dtype, causal):
    q_lens, seq_lens, hq, hkv, d, bs = CASES[case]
    inputs = make_prefill_inputs(q_lens, seq_lens, hq, hkv, d, bs, dtype, device="cuda", layout=layout)
    out, lse = run_sm90(inputs, causal)
    ref_o, ref_lse = device_reference(*inputs, causal=causal)
    assert_close_state(out, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_poisoned_slots_and_padded_table(value):
    """Slots past each length hold NaN/inf and tables are padded with a real block id: the last
    page's dead rows are masked (K) and zeroed (V), pages past the length are never loaded."""
    q, k, v, bt, sl, qsl = make_prefill_inputs([300, 40, 1], [317, 40, 1000], 32, 8, 128, 16, BF16, device="cuda",
                                               extra_cols=4)
    bt = pad_table(bt, sl, 16, pad_block=k.shape[0] - 1)
    poison_outside(k, v, bt, sl, value)
    for causal in (True, False):
        out, lse = run_sm90((q, k, v, bt, sl, qsl), causal)
        ref_o, ref_lse = device_reference(q, k, v, bt, sl, qsl, causal=causal)
        assert_close_state(out, lse, ref_o, ref_lse, BF16)


def test_sinks():
    inputs = make_prefill_inputs([200, 3], [500, 90], 32, 8, 128, 16, BF16, device="cuda")
    sinks = torch.randn(32, device="cuda") * 3
    out, lse = run_sm90(inputs, sinks=sinks)
    ref_o, ref_lse = device_reference(*inputs)
    total = torch.logaddexp(ref_lse, sinks.double().cpu()[None, :])
    assert_close_state(out, lse, ref_o * torch.exp(ref_lse - total)[..., None], total, BF16)


@pytest.mark.parametrize("softcap", [30.0, 2.0])
def test_softcap(softcap):
    """Soft-capped scores (Gemma 2), capped with ``tanh.approx`` as the portable kernels do for
    half-precision inputs."""
    inputs = make_prefill_inputs([200, 3], [500, 90], 32, 8, 128, 16, BF16, device="cuda")
    q, k, v, bt, sl, qsl = inputs
    assert prefill_kernel_name(q, k, v, softcap=softcap) == "sm90"
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl, causal=True, softcap=softcap, return_lse=True)
    ref_o, ref_lse = prefill_reference(*(t.cpu() for t in inputs), causal=True, softcap=softcap)
    assert_close_state(out, lse, ref_o, ref_lse, BF16)


def test_bitwise_deterministic_and_matches_portable():
    inputs = make_prefill_inputs([2048, 100], [4096, 333], 32, 8, 128, 16, BF16, device="cuda")
    first = run_sm90(inputs)
    again = run_sm90(inputs)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    q, k, v, bt, sl, qsl = inputs
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    from paged_backend.kernels.prefill import prefill_triton
    prefill_triton(q, k, v, bt, sl, qsl, q.shape[-1] ** -0.5, True, out, lse)
    assert (first[1] - lse).abs().max().item() < 1e-3
    assert_close_state(first[0], None, out, None, BF16)


def test_graph_replays_claim_every_item():
    """The programs claim their items from a counter the call zeroes itself: replays of a captured call (new
    queries each time, more items than programs) give an eager call's bits, every item done once."""
    inputs = make_prefill_inputs([2048, 100, 700], [4096, 333, 700], 32, 8, 128, 16, BF16, device="cuda")
    q = inputs[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_sm90(inputs)  # compiled and its launch keyed outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run_sm90(inputs)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref_o, ref_lse = run_sm90(inputs)
        assert torch.equal(out, ref_o) and torch.equal(lse, ref_lse)


def test_queries_without_a_tma_view():
    """Queries at an address TMA cannot read (2 bytes past 16-byte alignment): the consumers load them
    themselves - the dense reference's results, bitwise those of the TMA path."""
    inputs = make_prefill_inputs([300, 77], [1000, 77], 32, 8, 128, 16, BF16, device="cuda")
    q = inputs[0]
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = flat[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16
    out, lse = run_sm90((shifted, *inputs[1:]))
    assert_close_state(out, lse, *device_reference(*inputs), BF16)
    tma_o, tma_lse = run_sm90(inputs)
    assert torch.equal(out, tma_o) and torch.equal(lse, tma_lse)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_inputs(inputs, kv_dtype, k_scale=0.05, v_scale=0.02):
    """``inputs`` with their caches quantized to ``kv_dtype`` (per-tensor scales, the caches' strides kept)
    -> (inputs, the scales as keywords, the dequantized caches in fp32 that the reference reads)."""
    q, k, v, *meta = inputs
    k8, v8 = (torch.empty_strided(c.shape, c.stride(), dtype=kv_dtype, device=c.device) for c in (k, v))
    k8.copy_((k.float() / k_scale).to(kv_dtype))
    v8.copy_((v.float() / v_scale).to(kv_dtype))
    return (q, k8, v8, *meta), dict(k_scale=k_scale, v_scale=v_scale), (k8.float() * k_scale, v8.float() * v_scale)


def run_sm90_fp8(inputs, scales, causal=True, softcap=None, sinks=None):
    q, k, v, bt, sl, qsl = inputs
    pair = (torch.tensor([scales["k_scale"]]), torch.tensor([scales["v_scale"]]))
    assert prefill_kernel_name(q, k, v, softcap=softcap or 0.0, scales=pair) == "sm90"
    return pb.paged_prefill(q, k, v, bt, sl, qsl, causal=causal, softcap=softcap, sinks=sinks, return_lse=True,
                            **scales)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_dtype, dtype", [(FP8[0], BF16), (FP8[1], F16)], ids=["e4m3-bf16", "e5m2-fp16"])
@pytest.mark.parametrize("case", ["one prompt", "chunks mid-page, decodes, empty", "d64 mha bs32", "group 8 pages 256",
                                  "group 64"])
def test_fp8_cache_against_fp64(case, kv_dtype, dtype, causal):
    """fp8 caches: the converter's fp16 tiles (fp8 -> fp16 is exact), bf16 queries saturated to fp16 (as the
    portable kernel takes them), the scales folded in - against the fp64 reference on the dequantized cache;
    the vLLM layout's strided caches too."""
    q_lens, seq_lens, hq, hkv, d, bs = CASES[case]
    layout = "vllm" if case == "one prompt" else "nhd"
    inputs = make_prefill_inputs(q_lens, seq_lens, hq, hkv, d, bs, dtype, device="cuda", layout=layout)
    inputs8, scales, (k_deq, v_deq) = fp8_inputs(inputs, kv_dtype)
    out, lse = run_sm90_fp8(inputs8, scales, causal)
    q, _, _, bt, sl, qsl = inputs
    assert_close_state(out, lse, *device_reference(q, k_deq, v_deq, bt, sl, qsl, causal=causal), dtype)


def test_fp8_cache_poisoned_slots_softcap_sinks_and_bits():
    """An fp8 cache whose slots past each length hold NaN (e4m3 has no infinities), soft-capped, with sinks:
    masked / zeroed as over 16-bit caches; two calls give the same bits; queries TMA cannot read give the same
    bits too."""
    inputs = make_prefill_inputs([300, 40, 1], [317, 40, 1000], 32, 8, 128, 16, BF16, device="cuda", extra_cols=4)
    (q, k, v, bt, sl, qsl), scales, (k_deq, v_deq) = fp8_inputs(inputs, torch.float8_e4m3fn)
    bt = pad_table(bt, sl, 16, pad_block=k.shape[0] - 1)
    poison_outside(k, v, bt, sl, float("nan"))
    sinks = torch.randn(32, device="cuda") * 3
    out, lse = run_sm90_fp8((q, k, v, bt, sl, qsl), scales, softcap=30.0, sinks=sinks)
    ref_o, ref_lse = prefill_reference(q.cpu(), k_deq.cpu(), v_deq.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), causal=True,
                                       softcap=30.0)
    total = torch.logaddexp(ref_lse, sinks.double().cpu()[None, :])
    assert_close_state(out, lse, ref_o * torch.exp(ref_lse - total)[..., None], total, BF16)
    again = run_sm90_fp8((q, k, v, bt, sl, qsl), scales, softcap=30.0, sinks=sinks)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = flat[1:].view(q.shape)
    shifted.copy_(q)
    got = run_sm90_fp8((shifted, k, v, bt, sl, qsl), scales, softcap=30.0, sinks=sinks)
    assert torch.equal(out, got[0]) and torch.equal(lse, got[1])


def _column(t, width=3, col=1):
    """``t`` as column ``col`` of a wider buffer (its last dim ``width`` elements apart, -7 between):
    how engines pass metadata (a slice of a persistent batch buffer)."""
    buf = torch.full((*t.shape, width), -7, dtype=t.dtype, device=t.device)
    buf[..., col] = t
    return buf[..., col]


_gen = torch.Generator().manual_seed(5)
_many_q = torch.randint(0, 4, (1100,), generator=_gen)
STRIDED_CASES = {  # q_lens, seq_lens, Hq, Hkv, D, BS, layout
    "test_outside_rows' shape": ([4, 5, 1, 16, 0], [20, 5, 33, 16, 7], 8, 2, 64, 16, "vllm"),
    "long chunks": ([1000, 1, 300, 0, 129], [1000, 50, 517, 33, 2000], 32, 8, 128, 16, "nhd"),
    # B + 1 > 1024: the request search walks query_start_loc in two blocks
    "1100 requests": (_many_q.tolist(), (_many_q + torch.randint(0, 40, (1100,), generator=_gen)).tolist(),
                      32, 8, 128, 16, "nhd"),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", list(STRIDED_CASES))
def test_strided_metadata_gives_the_same_bits(case, causal):
    """block_table / seq_lens / query_start_loc as strided views (columns of wider buffers, a
    column-major table) give the contiguous call's bits: the kernel reads them with their strides
    (reading them as contiguous took other entries, and out-of-range query rows faulted)."""
    q_lens, seq_lens, hq, hkv, d, bs, layout = STRIDED_CASES[case]
    q, k, v, bt, sl, qsl = make_prefill_inputs(q_lens, seq_lens, hq, hkv, d, bs, BF16, device="cuda", layout=layout,
                                               extra_cols=2)
    bt = pad_table(bt, sl, bs, pad_block=k.shape[0] - 1)
    want = run_sm90((q, k, v, bt, sl, qsl), causal)
    assert_close_state(*want, *device_reference(q, k, v, bt, sl, qsl, causal=causal), BF16)
    for meta in ((_column(bt), _column(sl), _column(qsl)),
                 (bt.t().contiguous().t(), _column(sl, 5, 4), qsl),
                 (bt, sl, _column(qsl, 2, 0))):
        got = run_sm90((q, k, v, *meta), causal)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_uncovered_calls_fall_back():
    q, k, v, bt, sl, qsl = make_prefill_inputs([64], [64], 32, 8, 128, 16, BF16, device="cuda")
    assert prefill_kernel_name(q, k, v, window=16) == "portable"
    (_, k8, v8, *_), _, _ = fp8_inputs((q, k, v), torch.float8_e4m3fn)
    scales = (torch.ones(1), torch.ones(1))
    assert prefill_kernel_name(q, k8, v8, window=16, scales=scales) == "portable"
    assert prefill_kernel_name(q, k.float(), v.float()) == "portable"  # q and cache dtypes differ
    q8, k8, v8, *_ = make_prefill_inputs([64], [64], 32, 8, 128, 8, BF16, device="cuda")
    assert prefill_kernel_name(q8, k8, v8) == "portable"  # pages of 8
    q80, k80, v80, *_ = make_prefill_inputs([64], [64], 32, 8, 80, 16, BF16, device="cuda")
    assert prefill_kernel_name(q80, k80, v80) == "portable"  # head size 80


def test_a_call_like_an_earlier_one_launches_direct(monkeypatch):
    """The Hopper kernel goes through ``launch`` (its TMA descriptors keyed by their fields): a call
    with new tensors of the same shapes calls the compiled kernel directly, not ``JITFunction.run``
    (~160 us of host time a call on the H100 host), with the new caches' descriptors (their TMA maps
    encoded once and kept)."""
    from paged_backend.kernels import launch
    from paged_backend.kernels.prefill_sm90 import _prefill_sm90_kernel
    first = make_prefill_inputs([300, 20], [700, 20], 32, 8, 128, 16, BF16, device="cuda")
    run_sm90(first)
    second = make_prefill_inputs([300, 20], [700, 20], 32, 8, 128, 16, BF16, device="cuda")

    def normal_path(*a, **k):
        raise AssertionError("launched through JITFunction.run")
    monkeypatch.setattr(_prefill_sm90_kernel, "run", normal_path)
    out, lse = run_sm90(second)
    ref_o, ref_lse = device_reference(*second)
    assert_close_state(out, lse, ref_o, ref_lse, BF16)
    # Triton 3.6: the C launcher called directly, the second queries' and caches' TMA maps kept (arguments 1-3)
    entries = [e for e in launch._entries.values() if e and e[0] is _prefill_sm90_kernel]
    assert entries and all(e[6] is not None for e in entries)
    maps = {(i + 1, t.data_ptr()) for i, t in enumerate(second[:3])}
    assert any(maps <= e[6].maps.keys() for e in entries)
