"""Every bad argument of write_kv, paged_decode and the merges raises an error naming it."""
import re

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.decode import _checked
from paged_inputs import make_decode_inputs


@pytest.fixture
def dec():
    q, k, v, bt, sl = make_decode_inputs([20, 5], 8, 2, 64, 16, torch.float32)
    return dict(q=q, k_cache=k, v_cache=v, block_table=bt, seq_lens=sl)


def call_decode(args, **kw):
    a = dict(args)
    a.update(kw)
    return pb.paged_decode(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("block_table"), a.pop("seq_lens"),
                           **a)


DECODE_CASES = [
    (lambda a: dict(q=a["q"].numpy()), TypeError, "q"),
    (lambda a: dict(q=a["q"][0]), ValueError, "q"),
    (lambda a: dict(q=a["q"].half()), TypeError, "q"),
    (lambda a: dict(q=a["q"].int()), TypeError, "q"),
    (lambda a: dict(q=a["q"][:, :, :32]), ValueError, "q"),
    (lambda a: dict(q=a["q"][:, :5]), ValueError, "heads"),
    (lambda a: dict(k_cache=a["k_cache"][0]), ValueError, "k_cache"),
    (lambda a: dict(v_cache=a["v_cache"][:-1]), ValueError, "v_cache"),
    (lambda a: dict(v_cache=a["v_cache"].half()), TypeError, "v_cache"),
    (lambda a: dict(k_cache=a["k_cache"][:, :12], v_cache=a["v_cache"][:, :12]), ValueError, "block size"),
    (lambda a: dict(k_cache=torch.randn(8, 16, 2, 72), v_cache=torch.randn(8, 16, 2, 72),
                    q=torch.randn(2, 8, 72)), ValueError, "head dim"),
    (lambda a: dict(block_table=a["block_table"].long()), TypeError, "block_table"),
    (lambda a: dict(block_table=a["block_table"][0]), ValueError, "block_table"),
    (lambda a: dict(block_table=a["block_table"][:1]), ValueError, "block_table"),
    (lambda a: dict(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens"),
    (lambda a: dict(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens"),
    (lambda a: dict(seq_lens=torch.tensor([20, -1], dtype=torch.int32)), ValueError, "seq_lens"),
    (lambda a: dict(seq_lens=torch.tensor([10 ** 6, 5], dtype=torch.int32)), ValueError, "capacity"),
    (lambda a: dict(scale=0.0), ValueError, "scale"),
    (lambda a: dict(scale=float("nan")), ValueError, "scale"),
    (lambda a: dict(scale="0.1"), TypeError, "scale"),
    (lambda a: dict(plan="plan"), TypeError, "plan"),
    (lambda a: dict(plan=pb.plan_decode([20, 5, 1], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                                        device="cpu")), ValueError, "plan.batch_size"),
    (lambda a: dict(plan=pb.plan_decode([20, 5], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                                        device="cpu") .update([20, 10 ** 6])), ValueError, "capacity"),
    (lambda a: dict(plan=pb.plan_decode([20, 5], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                                        device="cpu")), ValueError, "plan.head_dim"),
    (lambda a: dict(out=a["q"].numpy()), TypeError, "^out "),
    (lambda a: dict(out=torch.empty(2, 8, 32)), ValueError, "^out "),
    (lambda a: dict(out=torch.empty(2, 8, 64, dtype=torch.half)), TypeError, "^out "),
    (lambda a: dict(out=torch.empty(2, 8, 64, device="meta")), ValueError, "^out "),
    (lambda a: dict(out=torch.empty(8, 2, 64).transpose(0, 1)), ValueError, "^out must be contiguous"),
    (lambda a: dict(lse_out=[0.0]), TypeError, "^lse_out "),
    (lambda a: dict(lse_out=torch.empty(2, 8, dtype=torch.float64)), TypeError, "^lse_out "),
    (lambda a: dict(lse_out=torch.empty(8, 2)), ValueError, "^lse_out "),
    (lambda a: dict(lse_out=torch.empty(8, 2).t()), ValueError, "^lse_out must be contiguous"),
]


@pytest.mark.parametrize("change,err,match", DECODE_CASES)
def test_decode_bad_argument(dec, change, err, match):
    with pytest.raises(err, match=match):
        call_decode(dec, **change(dec))


def plan_for(lens):
    return pb.plan_decode(lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu")


@pytest.mark.parametrize("change,err,match", DECODE_CASES)
def test_decode_with_a_plan_raises_what_the_full_checks_raise(dec, change, err, match):
    """With a matching plan the usual call takes the quick checks: whatever the full checks reject
    must still raise their error. (With a plan, lengths are checked on its host copy.)"""
    a = dict(dec, plan=plan_for([20, 5]))
    a.update(change(dec))
    try:
        _checked(a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"], a.get("scale"), a["plan"],
                 a.get("out"), a.get("lse_out"))
    except (TypeError, ValueError) as e:
        with pytest.raises(type(e), match=re.escape(str(e))):
            call_decode(a)


def test_decode_checks_a_plan_again_after_update(dec):
    plan = plan_for([20, 5])
    call_decode(dec, plan=plan)
    plan.update([20, 10 ** 6])
    with pytest.raises(ValueError, match="capacity"):
        call_decode(dec, plan=plan)
    plan.update([20, 5])
    call_decode(dec, plan=plan)


def test_plan_keeps_its_own_lengths(dec):
    lens = np.array([20, 5])
    plan = plan_for(lens)
    lens[1] = 10 ** 6  # the caller's array, changed after planning, is not the plan's
    assert plan.seq_lens_host.tolist() == [20, 5]
    call_decode(dec, plan=plan)
    with pytest.raises(ValueError, match="read-only"):
        plan.seq_lens_host[1] = 10 ** 6


def test_decode_checks_replaced_plan_fields(dec):
    plan = plan_for([20, 5])
    call_decode(dec, plan=plan)
    plan.seq_lens_host = np.array([20, 10 ** 6])
    with pytest.raises(ValueError, match="capacity"):
        call_decode(dec, plan=plan)
    plan = plan_for([20, 5])
    plan.num_q_heads = 4
    with pytest.raises(ValueError, match="plan.num_q_heads"):
        call_decode(dec, plan=plan)


@pytest.mark.parametrize("with_plan", [False, True])
def test_decode_debug_mode_checks_block_ids(dec, monkeypatch, with_plan):
    plan = plan_for([20, 5]) if with_plan else None
    call_decode(dec, plan=plan)
    monkeypatch.setenv("PAGED_BACKEND_DEBUG", "1")
    bt = dec["block_table"].clone()
    bt[1, 0] = 10 ** 6
    with pytest.raises(ValueError, match="block_table"):
        call_decode(dec, block_table=bt, plan=plan)
    bt[1, 0] = -3
    with pytest.raises(ValueError, match="block_table"):
        call_decode(dec, block_table=bt, plan=plan)


def test_decode_ignores_unused_table_entries(dec, monkeypatch):
    monkeypatch.setenv("PAGED_BACKEND_DEBUG", "1")
    bt = dec["block_table"].clone()
    bt[1, 1:] = -7  # request 1 has 5 tokens: one block used
    call_decode(dec, block_table=bt)


@pytest.fixture
def kv():
    k = torch.randn(4, 16, 2, 64)
    return dict(key=torch.randn(3, 2, 64), value=torch.randn(3, 2, 64), k_cache=k, v_cache=torch.randn_like(k),
                slot_mapping=torch.tensor([0, 5, -1]))


@pytest.mark.parametrize("change,err,match", [
    (lambda a: dict(key=a["key"].half()), TypeError, "key"),
    (lambda a: dict(key=a["key"][:, :1]), ValueError, "key"),
    (lambda a: dict(value=a["value"][:2]), ValueError, "value"),
    (lambda a: dict(value=[1, 2]), TypeError, "value"),
    (lambda a: dict(slot_mapping=a["slot_mapping"].int()), TypeError, "slot_mapping"),
    (lambda a: dict(slot_mapping=a["slot_mapping"][:2]), ValueError, "slot_mapping"),
    (lambda a: dict(slot_mapping=torch.tensor([0, 64, 1])), ValueError, "slot_mapping"),
    (lambda a: dict(slot_mapping=torch.tensor([0, -2, 1])), ValueError, "slot_mapping"),
    (lambda a: dict(k_cache=a["k_cache"][..., :60], v_cache=a["v_cache"][..., :60]), ValueError, "head dim"),
])
def test_write_kv_bad_argument(kv, change, err, match):
    a = dict(kv)
    a.update(change(kv))
    k0 = kv["k_cache"].clone()
    with pytest.raises(err, match=match):
        pb.write_kv(a["key"], a["value"], a["k_cache"], a["v_cache"], a["slot_mapping"])
    assert torch.equal(kv["k_cache"], k0), "a rejected call must not write"


@pytest.mark.parametrize("args,err,match", [
    (lambda o, l: (o, l.double(), o, l), TypeError, "lse_a"),
    (lambda o, l: (o, l, o.half(), l), TypeError, "o_b"),
    (lambda o, l: (o, l, o[:1], l[:1]), ValueError, "o_b"),
    (lambda o, l: (o, l[:, :1], o, l), ValueError, "lse_a"),
    (lambda o, l: (o[0], l, o, l), ValueError, "o_a"),
    (lambda o, l: (o, l, o, "x"), TypeError, "lse_b"),
])
def test_merge_bad_argument(args, err, match):
    o, lse = torch.randn(3, 4, 64), torch.randn(3, 4)
    with pytest.raises(err, match=match):
        pb.merge_states(*args(o, lse))


def test_merge_many_bad_arguments():
    o, lse = torch.randn(2, 3, 4, 64), torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="o_stack"):
        pb.merge_states_many(o[0], lse)
    with pytest.raises(ValueError, match="lse_stack"):
        pb.merge_states_many(o, lse[:1])
    with pytest.raises(ValueError, match="o_stack"):
        pb.merge_states_many(o[:0], lse[:0])
    with pytest.raises(TypeError, match="lse_stack"):
        pb.merge_states_many(o, lse.half())


def test_decode_refuses_a_plan_for_shorter_lengths(dec):
    """The kernels attend min(plan length, seq_lens), the torch path seq_lens: a plan made for
    shorter lengths than host seq_lens is an error; one made from upper bounds is exact."""
    with pytest.raises(ValueError, match=r"^plan .*seq_lens.*request 0"):
        call_decode(dec, plan=plan_for([19, 5]))
    want = call_decode(dec)
    got = call_decode(dec, plan=plan_for([32, 30]))  # upper bounds: same result
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_plan_for_shorter_lengths(monkeypatch):
    """On the GPU the kernels attend min(plan length, seq_lens) keys; PAGED_BACKEND_DEBUG=1 reads
    the device lengths and refuses the plan."""
    q, k, v, bt, sl = make_decode_inputs([300, 50], 8, 2, 64, 16, torch.bfloat16, device="cuda")
    short = pb.plan_decode([200, 50], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cuda")
    got, _ = pb.paged_decode(q, k, v, bt, sl, plan=short)
    want, _ = pb.paged_decode(q, k, v, bt, torch.tensor([200, 50], dtype=torch.int32, device="cuda"))
    assert torch.equal(got, want)
    monkeypatch.setenv("PAGED_BACKEND_DEBUG", "1")
    with pytest.raises(ValueError, match="^plan .*shorter"):
        pb.paged_decode(q, k, v, bt, sl, plan=short)
