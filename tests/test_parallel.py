"""Cross-process attention-state merging (tree_merge), context-parallel decode, the 2-D TP x CP mesh
and the ring baseline, on CPU with gloo. One spawned job per world size batches many checks (each
process pays a torch import); a dead and a hung peer must raise a clear error within the timeout."""
from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import paged_backend as pb
from paged_backend.parallel.context import (Placement, cp_decode, make_mesh, ring_decode, shard_paged_kv,
                                            tp_head_slices)
from paged_backend.parallel import merge_plans
from paged_backend.parallel import CollectiveError, TreeMerger, get_merger, make_hierarchy, tree_merge
from paged_inputs import make_decode_inputs, poison_outside, strided
from reference import attend, assert_close_state, decode_reference, rel_err

COLLECTIVE_TIMEOUT_S = 6  # process-group timeout in the dead/hung-peer jobs


# ----------------------------------------------------------------------------------------------
# harness
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(job, rank: int, world: int, port: int, results, backend: str):
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = COLLECTIVE_TIMEOUT_S if job in ("dead", "hang") else 60
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        out = (JOBS[job] if isinstance(job, str) else job)(rank, world)
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # never wait on a peer in teardown (the dead-peer job has broken groups)


def _launch(job, world: int, expect=None, timeout: float = 120.0, backend: str = "gloo") -> dict:
    """Runs ``JOBS[job]`` (or ``job`` itself, a module-level function ``(rank, world)``) on ``world``
    ranks (gloo; with nccl rank r uses GPU r); returns {rank: result} of the ranks in ``expect``
    (default all). Bounded: leftovers are killed. The port is free when picked but may be taken
    before rank 0 listens on it (another process's connection): then the job runs again on another."""
    for attempt in range(3):
        try:
            return _launch_once(job, world, expect, timeout, backend)
        except AssertionError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def _launch_once(job, world: int, expect, timeout: float, backend: str) -> dict:
    expect = set(range(world)) if expect is None else set(expect)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(job, r, world, port, results, backend), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, errors, deadline = {}, {}, time.monotonic() + timeout
    try:
        while len(got) + len(errors) < len(expect) and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            (got if status == "ok" else errors)[rank] = payload
            if errors:  # the others may now wait on the failed rank: give them a moment, then stop
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=5 if r in expect else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    missing = expect - set(got)
    assert not missing, f"job {job!r}: ranks {sorted(missing)} gave no result within {timeout}s"
    return got


# ----------------------------------------------------------------------------------------------
# checks run inside the ranks
def _merge_reference(o_stack, lse_stack):
    """fp64 merge of stacked states [P, T, H, D], [P, T, H] (independent of the package)."""
    o_stack, lse_stack = o_stack.double(), lse_stack.double()
    lse = torch.logsumexp(lse_stack, dim=0)
    w = torch.exp(lse_stack - lse[None]).nan_to_num(0.0)  # all-empty rows: -inf - -inf
    return (w[..., None] * o_stack).sum(0), lse


def _rank_states(rank, world, seq_lens, hq, hkv, d, q_scale, seed):
    """Same global data on every rank; rank r's state over its slice of each request (random uneven
    cuts, some ranks empty). -> (o_r, lse_r, o_stack, lse_stack, dense o, dense lse)."""
    g = torch.Generator().manual_seed(seed)
    states, dense_o, dense_lse = [], [], []
    for b, n in enumerate(seq_lens):
        q = torch.randn(1, hq, d, generator=g) * q_scale
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
        if b % 2 and world > 2:  # make a middle rank empty for this request
            cuts[0] = cuts[1] if world > 2 else cuts[0]
        bounds = [0] + cuts + [n]
        per = [attend(q, k[bounds[r]:bounds[r + 1]], v[bounds[r]:bounds[r + 1]], d ** -0.5) for r in range(world)]
        states.append(per)
        o, lse = attend(q, k, v, d ** -0.5)
        dense_o.append(o)
        dense_lse.append(lse)
    o_stack = torch.stack([torch.cat([s[r][0] for s in states]) for r in range(world)]).float()
    lse_stack = torch.stack([torch.cat([s[r][1] for s in states]) for r in range(world)]).float()
    return o_stack[rank], lse_stack[rank], o_stack, lse_stack, torch.cat(dense_o), torch.cat(dense_lse)


def _same_on_all_ranks(t) -> bool:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t.contiguous())
    return all(torch.equal(e, every[0]) for e in every)


def _check_tree_merge(rank, world):
    lens = [0, 1, 5, 37, 64, 3]  # request 0: empty on every rank
    hq, hkv, d = 4, 2, 16
    o, lse, o_stack, lse_stack, dense_o, dense_lse = _rank_states(rank, world, lens, hq, hkv, d, 1.0, 1)
    ref_o, ref_lse = _merge_reference(o_stack, lse_stack)
    variants = [dict(strategy=s) for s in ("auto", "allreduce", "allgather")]
    if world == 4:
        hier = make_hierarchy(2)
        variants += [dict(strategy=s, hierarchy=hier) for s in ("allreduce", "allgather")] + [dict(hierarchy=2)]
    outs = []
    for kw in variants:
        mo, ml = tree_merge(o, lse, **kw)
        assert mo.dtype == torch.float32 and ml.dtype == torch.float32, kw
        assert_close_state(mo, ml, ref_o, ref_lse, torch.float32)
        assert_close_state(mo, ml, dense_o, dense_lse, torch.float32)  # states are real attention of shards
        assert torch.equal(mo[0], torch.zeros_like(mo[0])) and bool(torch.isneginf(ml[0]).all()), kw
        outs.append(mo)
        mo2, ml2 = tree_merge(o, lse, **kw)
        assert torch.equal(mo, mo2) and torch.equal(ml, ml2), f"not deterministic: {kw}"
    for other in outs[1:]:
        assert rel_err(other, outs[0]) <= 1e-6
    ag_o, ag_lse = tree_merge(o, lse, strategy="allgather")
    assert _same_on_all_ranks(ag_o) and _same_on_all_ranks(ag_lse), "allgather: ranks disagree"
    # huge logits: ranks' lse differ by hundreds (weights underflow to 0), compare with the fp64 merge
    o, lse, o_stack, lse_stack, _, _ = _rank_states(rank, world, [9, 40, 17], 8, 1, 64, 40.0, 2)
    ref_o, ref_lse = _merge_reference(o_stack, lse_stack)
    for s in ("allreduce", "allgather"):
        mo, ml = tree_merge(o, lse, strategy=s)
        assert_close_state(mo, ml, ref_o, ref_lse, torch.float32)
    # lse = +inf marks an empty state (FlashAttention-2), as -inf does; its o may hold NaN
    o_inf, lse_inf = o.clone(), lse.clone()
    o_ref, lse_ref = o_stack.clone(), lse_stack.clone()
    o_ref[0, 1], lse_ref[0, 1] = 0.0, float("-inf")
    o_ref[:, 2], lse_ref[:, 2] = 0.0, float("-inf")  # empty on every rank: o = 0, lse = -inf
    if rank == 0:
        o_inf[1], lse_inf[1] = float("nan"), float("inf")
    o_inf[2], lse_inf[2] = float("nan"), float("inf")
    ref_o, ref_lse = _merge_reference(o_ref, lse_ref)
    for s in ("allreduce", "allgather"):
        mo, ml = tree_merge(o_inf, lse_inf, strategy=s)
        assert_close_state(mo, ml, ref_o, ref_lse, torch.float32)
        assert torch.all(mo[2] == 0) and bool(torch.isneginf(ml[2]).all()), s
    # bf16 and fp16 o keep their dtype; tolerance of the dtype
    for dt in (torch.bfloat16, torch.float16):
        o_lo, o_stack_lo = o.to(dt), o_stack.to(dt)
        ref_o, ref_lse = _merge_reference(o_stack_lo, lse_stack)
        for s in ("allreduce", "allgather"):
            mo, ml = tree_merge(o_lo, lse, strategy=s)
            assert mo.dtype == dt
            assert_close_state(mo, ml, ref_o, ref_lse, dt)
    # non-contiguous o, empty T
    o_nc = torch.randn(3, 16, 4).transpose(1, 2)
    lse_nc = torch.randn(3, 4) if rank else torch.full((3, 4), float("-inf"))
    for s in ("allreduce", "allgather"):
        mo, ml = tree_merge(o_nc, lse_nc, strategy=s)
        assert torch.isfinite(mo).all() and torch.isfinite(ml).all()
    o_odd = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(rank)).half()  # odd byte counts
    lse_odd = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))
    res = [tree_merge(o_odd, lse_odd, strategy=s) for s in ("allreduce", "allgather")]
    every_o = [torch.empty_like(o_odd) for _ in range(world)]
    every_l = [torch.empty_like(lse_odd) for _ in range(world)]
    dist.all_gather(every_o, o_odd)
    dist.all_gather(every_l, lse_odd)
    ref_o, ref_lse = _merge_reference(torch.stack(every_o), torch.stack(every_l))
    for mo, ml in res:
        assert_close_state(mo, ml, ref_o, ref_lse, torch.float16)
    mo, ml = tree_merge(torch.empty(0, 4, 8), torch.empty(0, 4))
    assert mo.shape == (0, 4, 8) and ml.shape == (0, 4)
    # argument errors name the argument (checked on every rank before any collective)
    for bad, name, exc in ((dict(hierarchy="x"), "hierarchy", TypeError), (dict(hierarchy=world + 1), "ranks_per_node",
                                                                          ValueError),
                           (dict(strategy="ring"), "strategy", ValueError)):
        with pytest.raises(exc, match=name):
            tree_merge(o, lse, **bad)


def _check_placement_slots(rank, world):
    bs = 4
    pl = Placement(world, rank, bs)
    lens = [0, 1, 3, 4, 5, 17, 33]
    torch.manual_seed(5)
    q, k, v, bt, sl = make_decode_inputs([n + 1 for n in lens], 4, 2, 64, bs, torch.float32)
    pos = torch.tensor(lens)  # position of the next token of each request
    bt_local = bt[:, pl.local_columns(bt.shape[1])]
    slots = pl.slot_mapping(pos, bt_local)
    mine = pl.owner(pos) == rank
    glob = bt.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    assert torch.equal(slots[mine], glob[mine]) and bool((slots[~mine] == -1).all())
    owners = mine.long()
    dist.all_reduce(owners)
    assert bool((owners == 1).all()), "each new token must have exactly one owner"


def _check_cp_decode(rank, world):
    pl = Placement(world, rank, 16)
    lens = [1, 15, 16, 17, 70, 0, 200]  # request 0: only rank 0 holds tokens; uneven shards
    for dt in (torch.float32, torch.bfloat16):
        torch.manual_seed(3)  # the same global data on every rank
        q, k, v, bt, sl = make_decode_inputs(lens, 8, 2, 64, 16, dt)
        ref_o, ref_lse = decode_reference(q, k, v, bt, sl)
        need = max(int(((Placement(world, r, 16).local_lens(sl.long()) + 15) // 16).sum()) for r in range(world))
        k_l, v_l, bt_l, sl_l = shard_paged_kv(k, v, bt, sl, pl, num_blocks=need + 1)
        assert torch.equal(sl_l.long(), pl.local_lens(sl.long()))
        poison_outside(k_l, v_l, bt_l, sl_l, float("nan"))  # slots past each local length: never read
        plan = pb.plan_decode(sl_l.numpy(), num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                              device="cpu")
        for fn, kw in ((cp_decode, dict(plan=plan)), (cp_decode, dict(strategy="allreduce")), (ring_decode, {})):
            o, lse = fn(q, k_l, v_l, bt_l, sl_l, **kw)
            assert o.dtype == dt
            assert_close_state(o, lse, ref_o, ref_lse, dt)
        o_s, lse_s = cp_decode(q, k_l, v_l, strided(bt_l), strided(sl_l), plan=plan)  # strided metadata
        assert torch.equal(o_s, cp_decode(q, k_l, v_l, bt_l, sl_l, plan=plan)[0])
        # no copy: the global cache with this rank's columns of the global table
        o, lse = cp_decode(q, k, v, bt[:, pl.local_columns(bt.shape[1])].contiguous(),
                           pl.local_lens(sl.long()).to(torch.int32))
        assert_close_state(o, lse, ref_o, ref_lse, dt)


def _check_cp_cascade(rank, world):
    """Cascade on each rank + tree_merge: a shared prefix stays shared (and leading) on every rank."""
    if not hasattr(pb, "cascade_decode"):
        return
    from paged_backend.parallel.context import cp_cascade_decode
    try:
        from paged_backend.cascade.plan import CascadeCost
        cost = dict(cost=CascadeCost(0, 0, 0))  # keep every shared block, however small
    except ImportError:
        cost = {}
    torch.manual_seed(6)
    q, k, v, bt, sl = make_decode_inputs([100, 90, 120, 5], 8, 2, 64, 16, torch.float32)
    bt[1:3, :5] = bt[0, :5]  # requests 0-2 share a 5-block prefix
    ref_o, ref_lse = decode_reference(q, k, v, bt, sl)
    k_l, v_l, bt_l, sl_l = shard_paged_kv(k, v, bt, sl, Placement(world, rank, 16))
    cplan = pb.plan_cascade(bt_l, sl_l, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                            device="cpu", **cost)
    if cost:
        assert not cplan.is_flat, "the shared prefix must survive the round-robin placement"
    o, lse = cp_cascade_decode(q, k_l, v_l, cplan)
    assert_close_state(o, lse, ref_o, ref_lse, torch.float32)


def _check_cp_features(rank, world):
    """Soft-capping, sinks (added once, to the merged state) and fp8 shards on the parallel path,
    flat and cascade; a window is refused (shards hold round-robin blocks)."""
    from paged_backend.parallel.context import cp_cascade_decode
    pl = Placement(world, rank, 16)
    torch.manual_seed(8)
    q, k, v, bt, sl = make_decode_inputs([1, 40, 200, 0], 8, 2, 64, 16, torch.float32, q_scale=4.0)
    sinks = torch.linspace(-1.0, 6.0, 8)
    k_l, v_l, bt_l, sl_l = shard_paged_kv(k, v, bt, sl, pl)
    o, lse = cp_decode(q, k_l, v_l, bt_l, sl_l, softcap=5.0, sinks=sinks)
    assert_close_state(o, lse, *decode_reference(q, k, v, bt, sl, softcap=5.0, sinks=sinks), torch.float32)
    fp8 = torch.float8_e4m3fn  # shards stored at scale 0.5; the reference reads the dequantized cache
    o, lse = cp_decode(q, (k_l / 0.5).to(fp8), (v_l / 0.5).to(fp8), bt_l, sl_l, k_scale=0.5, v_scale=0.5)
    ref = decode_reference(q, (k / 0.5).to(fp8).float() * 0.5, (v / 0.5).to(fp8).float() * 0.5, bt, sl)
    assert_close_state(o, lse, *ref, torch.float32)
    cplan = pb.plan_cascade(bt_l, sl_l, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu")
    o, lse = cp_cascade_decode(q, k_l, v_l, cplan, sinks=sinks)
    assert_close_state(o, lse, *decode_reference(q, k, v, bt, sl, sinks=sinks), torch.float32)
    with pytest.raises(ValueError, match="window"):
        cp_cascade_decode(q, k_l, v_l, cplan, window=8)


def _check_mesh(rank, world):
    mesh = make_mesh(2)
    assert (mesh.tp_size, mesh.cp_size) == (2, world // 2) and rank == mesh.cp_rank * 2 + mesh.tp_rank
    hq, hkv = 8, 4
    lens = [3, 40, 100]
    torch.manual_seed(4)
    q, k, v, bt, sl = make_decode_inputs(lens, hq, hkv, 64, 16, torch.float32)
    ref_o, ref_lse = decode_reference(q, k, v, bt, sl)
    sq, skv = tp_head_slices(hq, hkv, mesh.tp_size, mesh.tp_rank)
    pl = Placement.of(mesh.cp_group, 16)
    k_l, v_l, bt_l, sl_l = shard_paged_kv(k[:, :, skv], v[:, :, skv], bt, sl, pl)
    o, lse = cp_decode(q[:, sq].contiguous(), k_l, v_l, bt_l, sl_l, mesh.cp_group)
    assert_close_state(o, lse, ref_o[:, sq], ref_lse[:, sq], torch.float32)
    o, lse = cp_decode(q[:, sq].contiguous(), k_l, v_l, bt_l, sl_l, mesh.cp_group, hierarchy=1)
    assert_close_state(o, lse, ref_o[:, sq], ref_lse[:, sq], torch.float32)


class _Counting:
    """Counts calls of the collectives tree_merge uses (and of torch.cat, its pack copy)."""

    def __enter__(self):
        self.n = {"all_gather": 0, "all_reduce": 0, "cat": 0}
        self.saved = (merge_plans.all_gather_flat, dist.all_reduce, torch.cat)

        def wrap(name, fn):
            def counted(*a, **kw):
                self.n[name] += 1
                return fn(*a, **kw)
            return counted
        merge_plans.all_gather_flat = wrap("all_gather", self.saved[0])
        dist.all_reduce = wrap("all_reduce", self.saved[1])
        torch.cat = wrap("cat", self.saved[2])
        return self

    def take(self):
        n, self.n = self.n, {k: 0 for k in self.n}
        return n

    def __exit__(self, *exc):
        merge_plans.all_gather_flat, dist.all_reduce, torch.cat = self.saved


def _ptrs(merger):
    return sorted((lvl, kind, tuple(shape), name, t.data_ptr(), t.numel())
                  for lvl, kind, shape, bufs in merger.buffers() for name, t in bufs.items())


def _check_merger(rank, world):
    """Collectives per call are as designed; buffers are made once per shape and reused."""
    os.environ["PAGED_BACKEND_DEBUG"] = "0"  # the debug shape check would add a collective
    o, lse, o_stack, lse_stack, _, _ = _rank_states(rank, world, [3, 17, 40, 1], 4, 2, 16, 1.0, 7)
    ref_o, ref_lse = _merge_reference(o_stack, lse_stack)
    o2, lse2 = o.flip(0).contiguous(), lse.flip(0).contiguous()  # other data, same shapes
    ref2_o, ref2_lse = _merge_reference(o_stack.flip(1), lse_stack.flip(1))
    want = {"allgather": dict(all_gather=1, all_reduce=0, cat=1), "allreduce": dict(all_gather=0, all_reduce=2, cat=0)}
    with _Counting() as c:
        for strategy in ("allgather", "allreduce"):
            m = TreeMerger(strategy=strategy)
            mo, ml = m.merge(o, lse)
            assert c.take() == want[strategy], strategy
            assert_close_state(mo, ml, ref_o, ref_lse, torch.float32)
            first = _ptrs(m)
            assert len(first) == 2 and all(k == strategy for _, k, *_ in first), first
            mo2, ml2 = m.merge(o2, lse2)
            assert c.take() == want[strategy], strategy
            assert _ptrs(m) == first, f"{strategy}: buffers re-allocated for the same shapes"
            assert_close_state(mo2, ml2, ref2_o, ref2_lse, torch.float32)
            assert torch.equal(m.merge(o, lse)[0], mo), f"{strategy}: not deterministic"
            c.take()
            # tree_merge reuses one cached merger per (group, strategy, hierarchy)
            to, tl_ = tree_merge(o, lse, strategy=strategy)
            assert torch.equal(to, mo) and torch.equal(tl_, ml)
            cached = _ptrs(get_merger(strategy=strategy))
            tree_merge(o2, lse2, strategy=strategy)
            assert c.take() == {k: 2 * v for k, v in want[strategy].items()}
            assert _ptrs(get_merger(strategy=strategy)) == cached
        # auto picks the all-gather for this small state; a state written into the send views skips the pack
        m = TreeMerger()
        views = m.send_views(o.shape, o.dtype, o.device)
        assert views is not None
        views[0].copy_(o)
        views[1].copy_(lse)
        c.take()
        vo, vl = m.merge(*views)
        assert c.take() == dict(all_gather=1, all_reduce=0, cat=0)
        assert torch.equal(vo, tree_merge(o, lse, strategy="allgather")[0])
        assert TreeMerger(strategy="allreduce").send_views(o.shape, o.dtype, o.device) is None
        # a bounded cache drops the oldest shape
        m = TreeMerger(strategy="allgather", max_plans=2)
        for t in (1, 2, 3):
            m.merge(o[:t], lse[:t])
        assert sorted(s[0] for _, _, s, _ in m.buffers()) == [2, 3]
        c.take()
        if world == 4:  # 2 x 2: one collective per level; the node's state lands in the inter send buffer
            for strategy, n in (("allgather", dict(all_gather=2, all_reduce=0, cat=1)),
                                ("allreduce", dict(all_gather=0, all_reduce=4, cat=0))):
                m = TreeMerger(strategy=strategy, hierarchy=2)
                mo, ml = m.merge(o, lse)
                assert c.take() == n, strategy
                assert_close_state(mo, ml, ref_o, ref_lse, torch.float32)
                first = _ptrs(m)
                m.merge(o2, lse2)
                assert _ptrs(m) == first and c.take() == n, strategy
        # cp_decode: one all-gather per step, buffers reused across steps
        pl = Placement(world, rank, 16)
        torch.manual_seed(3)
        q, k, v, bt, sl = make_decode_inputs([5, 70, 33], 8, 2, 64, 16, torch.float32)
        ref_o, ref_lse = decode_reference(q, k, v, bt, sl)
        k_l, v_l, bt_l, sl_l = shard_paged_kv(k, v, bt, sl, pl)
        c.take()
        for _ in range(2):  # the local decode writes into the send buffer: no pack copy
            do, dl = cp_decode(q, k_l, v_l, bt_l, sl_l)
            assert c.take() == dict(all_gather=1, all_reduce=0, cat=0)
            assert_close_state(do, dl, ref_o, ref_lse, torch.float32)


def _job_merger(rank, world):
    _check_merger(rank, world)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # the Triton merge kernels on the CPU
        _check_tree_merge(rank, world)
    dist.barrier()


def _job_main(rank, world):
    t0 = time.monotonic()
    _check_tree_merge(rank, world)
    _check_placement_slots(rank, world)
    _check_cp_decode(rank, world)
    _check_cp_cascade(rank, world)
    _check_cp_features(rank, world)
    if world == 4:
        _check_mesh(rank, world)
    dist.barrier()  # rank 0 hosts the store: nobody leaves while others may still build groups
    return time.monotonic() - t0


def _job_dead(rank, world):
    """The last rank exits after joining; the others must get CollectiveError, not hang."""
    dist.barrier()
    if rank == world - 1:
        os._exit(0)
    time.sleep(0.5)
    o, lse = torch.randn(2, 4, 16), torch.randn(2, 4)
    t0 = time.monotonic()
    try:
        tree_merge(o, lse, strategy="allgather" if rank % 2 else "allreduce")
    except CollectiveError as e:
        return ("CollectiveError", str(e), time.monotonic() - t0)
    return ("no error", "", time.monotonic() - t0)


def _job_hang(rank, world):
    """The last rank stays alive but never joins: the collective times out."""
    dist.barrier()
    if rank == world - 1:
        time.sleep(60)
        return None
    t0 = time.monotonic()
    try:
        tree_merge(torch.randn(2, 4, 16), torch.randn(2, 4))
    except CollectiveError as e:
        return ("CollectiveError", str(e), time.monotonic() - t0)
    return ("no error", "", time.monotonic() - t0)


JOBS = {"main": _job_main, "merger": _job_merger, "dead": _job_dead, "hang": _job_hang}


# ----------------------------------------------------------------------------------------------
# tests
@pytest.mark.parametrize("world", [2, 3, 4])
def test_parallel_gloo(world):
    _launch("main", world)


@pytest.mark.kernel  # under TRITON_INTERPRET=1 (tests/run_cpu.sh) this also runs the Triton merge kernels
@pytest.mark.parametrize("world", [2, 4])
def test_tree_merger_collectives_and_buffers(world):
    _launch("merger", world)


@pytest.mark.parametrize("job,world", [("dead", 3), ("hang", 2)])
def test_peer_failure_raises_within_timeout(job, world):
    t0 = time.monotonic()
    got = _launch(job, world, expect=range(world - 1), timeout=COLLECTIVE_TIMEOUT_S + 60)
    for rank, (kind, msg, elapsed) in got.items():
        assert kind == "CollectiveError", f"rank {rank}: {kind}"
        assert "tree_merge" in msg and "peer" in msg, msg
        assert elapsed <= COLLECTIVE_TIMEOUT_S + 10, f"rank {rank} took {elapsed:.1f}s"
    assert time.monotonic() - t0 < COLLECTIVE_TIMEOUT_S + 70


def test_argument_errors_without_group():
    o, lse = torch.zeros(2, 4, 8), torch.zeros(2, 4)
    with pytest.raises(TypeError, match="lse"):
        tree_merge(o, lse.double())
    with pytest.raises(ValueError, match="lse"):
        tree_merge(o, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="^o "):
        tree_merge(o[0], lse)
    with pytest.raises(TypeError, match="^o "):
        tree_merge(o.double(), lse)
    with pytest.raises(ValueError, match="strategy"):
        tree_merge(o, lse, strategy="tree")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="group"):
            tree_merge(o, lse)
    with pytest.raises(ValueError, match="num_kv_heads"):
        tp_head_slices(32, 8, 3, 0)
    with pytest.raises(ValueError, match="rank"):
        Placement(2, 2, 16)


def test_placement_covers_every_token_once():
    for world in (1, 2, 3, 4):
        for bs in (1, 4, 16):
            lens = torch.arange(0, 70)
            total = torch.zeros_like(lens)
            for r in range(world):
                pl = Placement(world, r, bs)
                got = pl.local_lens(lens)
                want = torch.tensor([int((pl.owner(torch.arange(n)) == r).sum()) for n in lens.tolist()])
                assert torch.equal(got, want), (world, bs, r)
                assert pl.local_lens(37) == int(want[37])
                total += got
            assert torch.equal(total, lens)
