"""Logit soft-capping (``softcap``: every score ``x = scale * q.k`` becomes
``softcap * tanh(x / softcap)``) and attention sinks (``sinks [Hq]``: a logit per head in every
row's softmax denominator, value 0), alone and together, in decode (with and without a plan),
cascade (nodes and tails) and prefill, on both CPU paths and the GPU, against the fp64 dense
reference; bad values raise errors naming the argument."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade.plan import CascadeCost
from tests.paged_inputs import make_block_table, make_cache, make_decode_inputs
from tests.reference import assert_close_state, decode_reference, prefill_reference, rel_err

pytestmark = pytest.mark.kernel
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
Q_SCALE = 4.0  # large scores, so the cap changes the result (checked: featured != plain)
HQ = 8


def features(kind: str, device) -> dict:
    """The keyword arguments of one feature set; sinks of both signs, around the scores' scale."""
    sinks = torch.linspace(-2.0, 16.0, HQ, device=device)
    return {"softcap": dict(softcap=5.0), "sinks": dict(sinks=sinks),
            "both": dict(softcap=5.0, sinks=sinks)}[kind]


def _check(out, lse, ref, ref_plain, dtype):
    assert_close_state(out, lse, *ref, dtype)
    assert rel_err(ref[0], ref_plain[0]) > 0.05  # the case is one where the feature matters


KINDS = ["softcap", "sinks", "both"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("planned", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_decode(device, dtype, planned, kind):
    lens = [1, 37, 200, 5, 64, 0]  # (a request of length 0: with sinks out = 0, lse = sink)
    q, k, v, bt, sl = make_decode_inputs(lens, HQ, 2, 64, 16, dtype, device, q_scale=Q_SCALE)
    plan = pb.plan_decode(np.array(lens), num_q_heads=HQ, num_kv_heads=2, head_dim=64, block_size=16,
                          device=device) if planned else None
    kw = features(kind, device)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan, **kw)
    _check(out, lse, decode_reference(q, k, v, bt, sl, **kw), decode_reference(q, k, v, bt, sl), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_cascade(device, dtype, kind):
    """Eight requests share 4 blocks, two of them 2 more; every node kept (nodes and tails run)."""
    bs, shared = 16, [0, 1, 2, 3]
    rows = [shared + ([4, 5] if i < 2 else []) + [6 + i] for i in range(8)]
    lens = [len(r) * bs - (i % 5) for i, r in enumerate(rows)]
    table = np.zeros((8, 7), np.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    k, v = make_cache(14, bs, 2, 64, dtype, device)
    q = (torch.randn(8, HQ, 64, device=device) * Q_SCALE).to(dtype)
    bt, sl = torch.from_numpy(table).to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    cplan = pb.plan_cascade(table, np.array(lens), num_q_heads=HQ, num_kv_heads=2, head_dim=64, block_size=bs,
                            device=device, cost=CascadeCost(0, 0, 0))
    assert not cplan.is_flat
    kw = features(kind, device)
    out, lse = pb.cascade_decode(q, k, v, cplan, **kw)
    _check(out, lse, decode_reference(q, k, v, bt, sl, **kw), decode_reference(q, k, v, bt, sl), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill(device, dtype, causal, kind):
    """A fresh prompt, a chunk over a cached prefix and a decode row in one varlen batch."""
    lens, q_lens = [40, 90, 33], [40, 17, 1]
    k, v = make_cache(20, 16, 2, 64, dtype, device)
    bt = make_block_table(lens, 16, 20, device=device)
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    q = (torch.randn(sum(q_lens), HQ, 64, device=device) * Q_SCALE).to(dtype)
    kw = features(kind, device)
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl, causal=causal, **kw)
    ref = prefill_reference(q, k, v, bt, sl, qsl.cpu(), causal=causal, **kw)
    _check(out, lse, ref, prefill_reference(q, k, v, bt, sl, qsl.cpu(), causal=causal), dtype)


def test_softcap_saturates():
    """Scores far past the cap give the softmax of +-softcap, with no overflow."""
    q, k, v, bt, sl = make_decode_inputs([48], 4, 4, 64, 16, torch.float32, q_scale=1e4)
    out, lse = pb.paged_decode(q, k, v, bt, sl, softcap=1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl, softcap=1.0), torch.float32)
    assert (lse <= 1.0 + math.log(48) + 1e-4).all()


def test_sink_state_merges_with_states_without_it():
    """A state with the sink merged with one of other keys (without it) is the state of all the
    keys with the sink: the sink is counted once, where it was added."""
    lens = [70]
    q, k, v, bt, sl = make_decode_inputs(lens, HQ, 2, 64, 16, torch.float32)
    sinks = features("sinks", "cpu")["sinks"]
    first = bt.clone()
    first[0, 2:] = bt[0, 2]  # (the first 32 tokens: blocks 0, 1)
    o1, l1 = pb.paged_decode(q, k, v, first, torch.tensor([32], dtype=torch.int32), sinks=sinks)
    rest = bt[:, 2:].contiguous()  # the other 38 tokens
    o2, l2 = pb.paged_decode(q, k, v, rest, torch.tensor([38], dtype=torch.int32))
    o, lse = pb.merge_states(o1, l1, o2, l2)
    assert_close_state(o, lse, *decode_reference(q, k, v, bt, sl, sinks=sinks), torch.float32)


@pytest.mark.parametrize("bad, err", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                      (float("nan"), ValueError), ("30", TypeError), (True, TypeError)])
def test_bad_softcap(bad, err):
    _each_op_raises(dict(softcap=bad), err, "softcap")


@pytest.mark.parametrize("bad, err", [(torch.zeros(4, dtype=torch.bfloat16), TypeError),
                                      (torch.zeros(3), ValueError), (torch.zeros(4, 1), ValueError),
                                      (torch.zeros(8)[::2], ValueError), ([0.0] * 4, TypeError)])
def test_bad_sinks(bad, err):
    _each_op_raises(dict(sinks=bad), err, "sinks")


def _each_op_raises(kw, err, name):
    q, k, v, bt, sl = make_decode_inputs([20], 4, 2, 64, 16, torch.float32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    cplan = pb.plan_cascade(bt.numpy(), sl.numpy(), num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    for call in (lambda: pb.paged_decode(q, k, v, bt, sl, **kw),
                 lambda: pb.cascade_decode(q, k, v, cplan, **kw),
                 lambda: pb.paged_prefill(q, k, v, bt, sl, qsl, **kw)):
        with pytest.raises(err, match=name):
            call()
