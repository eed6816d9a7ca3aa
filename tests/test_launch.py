"""The direct launch (kernels/launch.py): its key, when it must take the normal path, and (GPU) that
it gives the same bits as the normal path."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

import paged_backend as pb
from paged_backend.kernels import launch
from paged_backend.kernels.cascade import _cascade_node_kernel
from paged_backend.kernels.decode import _decode_kernel, _fold_states_kernel
from paged_backend.kernels.dispatch import INTERPRET, use_sm90
from paged_backend.cascade import cascade_node_kernel_name
from paged_backend.cascade.plan import CascadeCost
from paged_inputs import make_cache, make_decode_inputs, misaligned


@triton.jit
def _scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def key(*args, **kw):
    return launch.arg_key(args, kw)


def triton_spec(*args):
    return [native_specialize_impl(BaseBackend, a, False, True, True) for a in args]


def test_key_tracks_alignment_and_dtype():
    x = torch.zeros(64, dtype=torch.float16)
    assert key(x) == key(x[8:]) == key(torch.zeros(3, dtype=torch.float16))  # 16-byte aligned
    assert key(x) != key(x[1:]) and key(x) != key(x[4:])  # 2 and 8 bytes off
    assert key(x) != key(x.float()) and key(x) != key(x.view(torch.bfloat16))


def test_key_tracks_ints_and_keyword_values():
    for a, b in [(1, 17), (16, 17), (16, 32), (2 ** 31 - 16, 2 ** 31), (0, -16)]:
        assert key(a) != key(b)
    assert key(3, 4, BLOCK=64, num_warps=4) != key(3, 4, BLOCK=64, num_warps=8)
    assert key(3, BLOCK=64) != key(3, BLOCK=128) != key(3, BLOCK=64, num_stages=2)


def test_key_tells_bool_int_float_apart():
    assert len({key(1), key(True), key(1.0)}) == 3
    assert len({key(BLOCK=1), key(BLOCK=True), key(BLOCK=1.0)}) == 3


def test_equal_keys_mean_equal_triton_specializations():
    x = torch.zeros(64)
    cases = [x, x[1:], x[4:], x.half(), x[2:].half(), 0, 1, 2, 16, 17, 2 ** 31, 2 ** 63, -16, True, 0.5, None]
    for a in cases:
        for b in cases:
            if key(a) == key(b):
                assert triton_spec(a) == triton_spec(b), (a, b)


def test_unknown_argument_types_have_no_key():
    assert key(torch.nn.Parameter(torch.zeros(4))) is None
    assert key([1, 2]) is None and key(np.int64(3)) is None


def test_disabled_by():
    assert launch.disabled_by(interpret=True, switch="1", version="3.6.0") == "TRITON_INTERPRET=1"
    assert launch.disabled_by(interpret=False, switch="0", version="3.6.0") == "PAGED_BACKEND_DIRECT_LAUNCH=0"
    for version in ("3.5.1", "3.10.0", "4.0.0"):
        assert "Triton" in launch.disabled_by(interpret=False, switch="1", version=version)
    for version in ("3.6.0", "3.9.0+git1234"):
        assert launch.disabled_by(interpret=False, switch="1", version=version) is None
    assert launch.DISABLED_BY == launch.disabled_by()


@pytest.fixture
def calls(monkeypatch):
    """The direct path switched on without a GPU: _scale's normal launches and its compiled kernel's
    launcher only record their calls."""
    seen = []
    compiled = SimpleNamespace(function="function", packed_metadata="packed",
                               run=lambda *a: seen.append(("direct",) + a))

    def run(*args, grid, warmup, **kw):
        seen.append(("normal", grid) + args)
        return compiled

    monkeypatch.setattr(_scale, "run", run)  # JITFunction.__getitem__ calls self.run
    monkeypatch.setattr(launch, "DISABLED_BY", None)
    monkeypatch.setattr(launch, "_device", lambda: 0)
    monkeypatch.setattr(launch, "_stream", lambda device: "stream")
    monkeypatch.setattr(launch, "_entries", {})
    return seen


def test_second_launch_calls_the_compiled_kernel(calls):
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launch.launch(_scale, (4,), x, y, 64, BLOCK=16, num_warps=2)
    assert calls == [("normal", (4,), x, y, 64),
                     ("direct", 4, 1, 1, "stream", "function", "packed", None, None, None, x, y, 64, 16),
                     ("direct", 4, 1, 1, "stream", "function", "packed", None, None, None, x, y, 64, 16)]


@pytest.mark.parametrize("change", [
    lambda x, y: ((x[1:], y, 63), {}),  # misaligned pointer
    lambda x, y: ((x, y.double(), 64), {}),  # dtype
    lambda x, y: ((x, y, 1), {}),  # an int that becomes 1
    lambda x, y: ((x, y, 17), {}),  # an int that is not a multiple of 16
    lambda x, y: ((x, y, 64), {"BLOCK": 32}),  # a constexpr
    lambda x, y: ((x, y, 64), {"num_warps": 4}),  # a launch option
])
def test_a_new_specialization_takes_the_normal_path_once(calls, change):
    x, y = torch.zeros(64), torch.zeros(64)
    kw = dict(BLOCK=16, num_warps=2)
    launch.launch(_scale, (4,), x, y, 64, **kw)
    args, new = change(x, y)
    for _ in range(2):
        launch.launch(_scale, (4,), *args, **dict(kw, **new))
    assert [c[0] for c in calls] == ["normal", "normal", "direct"]


def test_watchers_and_unknown_arguments_take_the_normal_path(calls, monkeypatch):
    x, y = torch.zeros(64), torch.zeros(64)
    launch.launch(_scale, (4,), x, y, 64, BLOCK=16)
    hook = lambda *a: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch.launch(_scale, (4,), x, y, 64, BLOCK=16)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    monkeypatch.setattr(_scale, "pre_run_hooks", [hook])
    launch.launch(_scale, (4,), x, y, 64, BLOCK=16)
    monkeypatch.setattr(_scale, "pre_run_hooks", [])
    for _ in range(2):
        launch.launch(_scale, (4,), torch.nn.Parameter(x), y, 64, BLOCK=16)
        launch.launch(_scale, (4,), x, n=64, y_ptr=y, BLOCK=16)  # a tensor by keyword
        launch.launch(_scale, lambda meta: (4,), x, y, 64, BLOCK=16)
    assert [c[0] for c in calls] == ["normal"] * 9
    launch.launch(_scale, (4,), x, y, 64, BLOCK=16)
    assert calls[-1][0] == "direct"


def test_a_kernel_reading_globals_always_takes_the_normal_path(calls, monkeypatch):
    monkeypatch.setattr(_scale, "used_global_vals", {("G", 0): (1, {"G": 1})})  # run() re-checks these
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launch.launch(_scale, (4,), x, y, 64, BLOCK=16)
    assert [c[0] for c in calls] == ["normal"] * 3


def test_constexpr_globals_do_not_stop_the_direct_path(calls, monkeypatch):
    monkeypatch.setattr(_scale, "used_global_vals", {("ROWS", 0): (tl.constexpr(64), {"ROWS": tl.constexpr(64)})})
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        launch.launch(_scale, (4,), x, y, 64, BLOCK=16)
    assert [c[0] for c in calls] == ["normal", "direct"]


def _descriptor(base, rows=64):
    """A Gluon TMA descriptor over ``base [rows, 64]`` bf16 (host side: no GPU needed)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
    return TensorDescriptor(base, [rows, 64], [64, 1], [16, 64], layout)


def test_descriptor_arguments_go_direct_keyed_by_their_fields(calls):
    """Gluon kernels take TMA descriptors: a new descriptor object with the same fields launches
    direct (passed to the launcher as it is), one with another shape or base dtype the normal way."""
    x, y = torch.zeros(64), torch.zeros(64, 64, dtype=torch.bfloat16)
    first, again = _descriptor(y), _descriptor(y)
    launch.launch(_scale, (4,), x, first, 64, BLOCK=16)
    launch.launch(_scale, (4,), x, again, 64, BLOCK=16)
    launch.launch(_scale, (4,), x, _descriptor(y, rows=32), 64, BLOCK=16)
    launch.launch(_scale, (4,), x, _descriptor(torch.zeros(64, 64, dtype=torch.float16)), 64, BLOCK=16)
    assert [c[0] for c in calls] == ["normal", "direct", "normal", "normal"]
    assert calls[1][10:] == (x, again, 64, 16)


def test_a_descriptor_relaunch_passes_descriptors_of_the_new_addresses(calls):
    """A launch with a TMA descriptor argument (Gluon kernels) relaunched with an address in the
    descriptor's place: the launcher gets a descriptor of that address with the bound one's shape,
    strides and padding, and no tensor behind it is kept."""
    x, y, y2 = torch.zeros(64), torch.zeros(64, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16)
    desc = _descriptor(y)
    relaunch = launch.DescriptorRelaunch(launch.launch(_scale, (4,), x, desc, 64, BLOCK=16), 2)
    assert launch.replay_stream([relaunch]) == "stream"
    relaunch("stream", 123, y2.data_ptr())
    direct = calls[-1]
    assert direct[:10] == ("direct", 4, 1, 1, "stream", "function", "packed", None, None, None)
    assert direct[10] == 123 and direct[12:] == (64, 16)
    passed = direct[11]
    assert passed.base.data_ptr() == y2.data_ptr() and (passed.shape, passed.strides, passed.padding) == \
        (desc.shape, desc.strides, desc.padding)
    assert relaunch.relaunch.tensors == []  # the descriptor's tensor was a leading argument


_TRITON_36_WRAPPER = """
_BASE_ARGS_FORMAT_LEN = 13

def make_tensordesc_arg(arg, metadata):
    encoded.append((arg.base.data_ptr(), metadata))
    return [("map", arg.base.data_ptr(), metadata), *arg.shape, *arg.strides]

def wrap(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):  # (3.6's reads these three and encodes every map again)
        raise AssertionError((launcher, tensordesc_indices, tensordesc_meta))
    return inner
"""


@pytest.fixture
def calls36(calls, monkeypatch):
    """As ``calls``, with a compiled kernel whose launcher has Triton 3.6's structure (a Python wrapper
    around the C launcher that would encode every descriptor's TMA map on every call): records the
    maps encoded and the C launcher's calls."""
    encoded = []
    env = {"encoded": encoded}
    exec(_TRITON_36_WRAPPER, env)
    run = SimpleNamespace(launch=env["wrap"](lambda *a: calls.append(("c",) + a), {1}, [{"swizzle": 128}]),
                          global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                          launch_pdl=True)
    compiled = SimpleNamespace(function="function", packed_metadata="packed", run=run)
    monkeypatch.setattr(_scale, "run",
                        lambda *args, grid, warmup, **kw: calls.append(("normal", grid) + args) or compiled)
    return calls, encoded


def test_descriptor_launches_keep_the_tma_maps_and_call_the_c_launcher(calls36):
    """Direct launches and descriptor relaunches of a kernel taking a TMA descriptor (Triton 3.6's
    launcher): each base address is encoded once and the C launcher gets the expanded arguments."""
    calls, encoded = calls36
    x, y, y2 = torch.zeros(64), torch.zeros(64, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16)
    desc = _descriptor(y)
    first = launch.launch(_scale, (4,), x, desc, 64, BLOCK=16)  # normal, then bound
    launch.launch(_scale, (4,), x, _descriptor(y), 64, BLOCK=16)  # direct
    relaunch = launch.DescriptorRelaunch(first, 2)
    for address in (y2.data_ptr(), y.data_ptr(), y2.data_ptr()):
        relaunch("stream", 123, address)
    meta = {"swizzle": 128}
    assert encoded == [(y.data_ptr(), meta), (y2.data_ptr(), meta)]  # once per address
    c = ("c", 4, 1, 1, "stream", "function", False, True, None, None, "packed", None, None, None)
    expanded = lambda a: (("map", a, meta), *desc.shape, *desc.strides)  # noqa: E731
    assert calls[0][0] == "normal" and calls[1:] == [
        (*c, x, *expanded(y.data_ptr()), 64, 16),
        *[(*c, 123, *expanded(a), 64, 16) for a in (y2.data_ptr(), y.data_ptr(), y2.data_ptr())]]


def test_a_relaunch_takes_new_leading_arguments(calls):
    """The leading arguments come as the caller passes them (device addresses); the bound launch's
    other tensors go to the launcher as addresses too, and the relaunch keeps them alive."""
    x, y, x2, y2 = torch.zeros(64), torch.zeros(64), torch.ones(64), torch.ones(64)
    first = launch.launch(_scale, (4,), x, y, 64, BLOCK=16, num_warps=2)  # normal, then bound
    second = launch.launch(_scale, (4,), x, y, 64, BLOCK=16, num_warps=2)  # direct
    for bound in (first, second):
        assert launch.replay_stream([bound.lead(1)]) == "stream"
        bound.lead(1)("stream", x2.data_ptr())
        bound.lead(2)("stream", x2.data_ptr(), y2.data_ptr())
        assert bound.lead(1).tensors == [y] and bound.lead(2).tensors == []
    direct = ("direct", 4, 1, 1, "stream", "function", "packed", None, None, None)
    assert calls[1:] == [direct + (x, y, 64, 16)] + [direct + (x2.data_ptr(), y.data_ptr(), 64, 16),
                                                     direct + (x2.data_ptr(), y2.data_ptr(), 64, 16)] * 2


def test_no_bound_launch_where_the_normal_path_runs(calls, monkeypatch):
    x, y = torch.zeros(64), torch.zeros(64)
    assert launch.launch(_scale, (4,), torch.nn.Parameter(x), y, 64, BLOCK=16) is None
    assert launch.launch(_scale, lambda meta: (4,), x, y, 64, BLOCK=16) is None
    monkeypatch.setattr(_scale, "used_global_vals", {("G", 0): (1, {"G": 1})})
    assert launch.launch(_scale, (4,), x, y, 64, BLOCK=16) is None
    monkeypatch.setattr(launch, "DISABLED_BY", "test")
    monkeypatch.setattr(_scale, "used_global_vals", {})
    assert launch.launch(_scale, (4,), x, y, 64, BLOCK=16) is None
    assert [c[0] for c in calls] == ["normal"] * 4


def test_replay_only_in_the_context_bound(calls, monkeypatch):
    x, y = torch.zeros(64), torch.zeros(64)
    relaunch = launch.launch(_scale, (4,), x, y, 64, BLOCK=16).lead(2)
    assert launch.replay_stream([relaunch]) == "stream"
    hook = lambda *a: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)  # a profiler
    try:
        assert launch.replay_stream([relaunch]) is None
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    with monkeypatch.context() as m:
        m.setattr(_scale, "pre_run_hooks", [hook])
        assert launch.replay_stream([relaunch]) is None
    with monkeypatch.context() as m:
        m.setattr(triton.knobs.runtime, "debug", True)  # a knob the compiler sees
        assert launch.replay_stream([relaunch]) is None
    with monkeypatch.context() as m:
        m.setattr(launch, "_device", lambda: 1)  # another current device
        assert launch.replay_stream([relaunch]) is None
    with monkeypatch.context() as m:
        m.setattr(launch, "DISABLED_BY", "PAGED_BACKEND_DIRECT_LAUNCH=0")
        assert launch.replay_stream([relaunch]) is None
    assert launch.replay_stream([relaunch]) == "stream"


@pytest.mark.kernel
@pytest.mark.skipif(not INTERPRET, reason="runs Triton kernels: the TRITON_INTERPRET=1 pass of run_cpu.sh")
def test_interpreter_takes_the_normal_path(monkeypatch):
    assert launch.DISABLED_BY == "TRITON_INTERPRET=1"
    q, k, v, bt, sl = make_decode_inputs([40, 3], 4, 2, 64, 16, torch.float32)
    plan = pb.plan_decode([40, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
                          num_programs=3, block_n=16)
    want = pb.paged_decode(q, k, v, bt, sl, plan=plan)
    # Even with the switch forced on, interpreted kernels are not JITFunctions: nothing is bound.
    monkeypatch.setattr(launch, "DISABLED_BY", None)
    monkeypatch.setattr(launch, "_entries", {})
    for _ in range(2):
        got = pb.paged_decode(q, k, v, bt, sl, plan=plan)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert launch._entries == {} and plan.launches == {}


def _assert_direct_matches_normal(monkeypatch, cases: dict, call, kernels: set, plan):
    """Each case through the normal path, then three rounds (the first binds, later ones go direct,
    specializations interleaved: the first through ``launch``, the others through the plan's
    relaunches) must give the same bits; ``kernels`` are the ones that went direct."""
    assert launch.DISABLED_BY is None, f"direct launch is off here: {launch.DISABLED_BY}"
    monkeypatch.setattr(launch, "DISABLED_BY", "test: the normal path")
    normal = {name: call(*args) for name, args in cases.items()}
    assert not plan.launches
    monkeypatch.setattr(launch, "DISABLED_BY", None)
    monkeypatch.setattr(launch, "_entries", {})
    replays = []
    relaunch, drelaunch = launch.Relaunch.__call__, launch.DescriptorRelaunch.__call__
    monkeypatch.setattr(launch.Relaunch, "__call__", lambda self, *a: (replays.append(self.fn), relaunch(self, *a)))
    # a Gluon kernel's relaunch calls the C launcher itself where it keeps TMA maps (Triton 3.6), else a Relaunch
    monkeypatch.setattr(launch.DescriptorRelaunch, "__call__",
                        lambda self, *a: (self.tma is not None and replays.append(self.fn), drelaunch(self, *a)))
    for _ in range(3):
        for name, args in cases.items():
            out, lse = call(*args)
            assert torch.equal(out, normal[name][0]) and torch.equal(lse, normal[name][1]), name
    torch.cuda.synchronize()
    assert {e[0] for e in launch._entries.values() if e} == kernels
    assert len(plan.launches) == len(cases)  # one signature each
    assert len(replays) == 2 * len(cases) * len(kernels) and set(replays) == kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["stream_k", "split"])
def test_gpu_direct_decode_gives_the_normal_bits(monkeypatch, dtype, mode):
    lens = [1, 17, 5000, 0, 333]
    q, k, v, bt, sl = make_decode_inputs(lens, 32, 8, 128, 16, dtype, device="cuda", layout="vllm")
    plan = pb.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                          mode=mode)
    cases = {"contiguous": (q, bt, sl), "misaligned q": (misaligned(q), bt, sl),
             "strided q": (q.transpose(0, 1).contiguous().transpose(0, 1), bt, sl),
             "misaligned table and lengths": (q, misaligned(bt), misaligned(sl))}
    _assert_direct_matches_normal(monkeypatch, cases, lambda q, bt, sl: pb.paged_decode(q, k, v, bt, sl, plan=plan),
                                  {_decode_kernel, _fold_states_kernel}, plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_direct_cascade_gives_the_normal_bits(monkeypatch):
    """The node kernel, the leaf pieces beside it (launch_pdl) and the fold through slots; on sm_90
    (``dispatch.use_sm90``) the node kernel is the Hopper one (kernels/cascade_sm90.py: a
    ``DescriptorRelaunch``), running the tails too where the plan has fused lists (no decode launch)."""
    bs, n, prefix, suffix = 16, 6, 4096, 300
    cols = -(-(prefix + suffix) // bs)
    shared = prefix // bs
    table = np.zeros((n, cols), dtype=np.int32)
    table[:, shared:] = shared + np.arange(n * (cols - shared)).reshape(n, cols - shared)
    table[:, :shared] = np.arange(shared)
    lens = np.full(n, prefix + suffix)
    k, v = make_cache(int(table.max()) + 1, bs, 8, 128, torch.bfloat16, device="cuda")
    q = torch.randn(n, 32, 128, device="cuda").to(torch.bfloat16)
    # (queries TMA cannot read: the Hopper node kernel without its tails, which read them by TMA; the portable
    # decode kernel runs those)
    for case, args in {"contiguous": (q,), "misaligned q": (misaligned(q),)}.items():
        cplan = pb.plan_cascade(table, lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=bs,
                                device="cuda", cost=CascadeCost(0, 0, 0))
        assert not cplan.is_flat
        name = cascade_node_kernel_name(*args, k, v, cplan)
        # (H100/H200 with the Triton release the Gluon kernels were checked on)
        if use_sm90(q.device):
            from paged_backend.kernels.cascade_sm90 import _cascade_node_sm90_kernel as sm90
            assert name in (("sm90", "sm90+tails") if case == "contiguous" else ("sm90",))
            node = {sm90} if name == "sm90+tails" else {sm90, _decode_kernel}
        else:
            assert name == "portable"
            node = {_cascade_node_kernel, _decode_kernel}
        _assert_direct_matches_normal(monkeypatch, {case: args}, lambda q, p=cplan: pb.cascade_decode(q, k, v, p),
                                      node | {_fold_states_kernel}, cplan)
