"""Cascade plans in a CascadeArena: a later step's plan of the same launch key runs through the
launches of an earlier plan (as a CUDA graph captured with it replays) and gives that step's
exact attention; plans that outgrow the arena are refused and fit a grown one."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade import CascadeArena, CascadeCost
from paged_backend.kernels.dispatch import use_triton
from tests.test_cascade import check_exact, forest_inputs, random_forest

KEEP_ALL = CascadeCost(0, 0, 0)


def steps_of_samples(bs: int, width: int, n: int, prompt: int, steps: int):
    """``n`` samples of one ``prompt``-token prompt decoding ``steps`` tokens each (private blocks
    appended as tails cross block boundaries) -> [(table [n, width] int32, lens [n] int64)] a step."""
    shared = prompt // bs
    table = np.zeros((n, width), np.int32)
    table[:, :shared] = np.arange(shared)
    nxt = shared
    out = []
    for t in range(steps):
        lens = np.full(n, prompt + 1 + t, np.int64)
        need = -(-lens // bs)
        for i in range(n):  # (plain loops: a test)
            for c in range(shared, int(need[i])):
                if table[i, c] == 0:  # (0 is a shared block: a private column not given one yet)
                    table[i, c], nxt = nxt, nxt + 1
        out.append((table.copy(), lens))
    return out, nxt


@pytest.mark.kernel
@pytest.mark.parametrize("bs,hq,hkv", [(4, 8, 2), (16, 4, 1)])
def test_later_plans_run_through_the_first_plans_launches(bs, hq, hkv):
    """Samples of one prompt decode step by step, planned into one arena with the forest carried
    over: each step's plan sits at the arena's addresses; where its launch key equals the first
    plan's, the first plan object (its launches, as a captured graph) gives this step's exact
    attention, which is most steps."""
    d, n, width = 64, 6, 16
    steps, nb = steps_of_samples(bs, width, n, prompt=5 * bs + 1, steps=2 * bs + 3)
    k = torch.randn(nb + 1, bs, hkv, d)
    v = torch.randn(nb + 1, bs, hkv, d)
    table_dev = torch.zeros(n, width, dtype=torch.int32)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cpu", cost=KEEP_ALL,
              block_table_device=table_dev)
    first = arena = prev = None
    same = 0
    for table, lens in steps:
        table_dev.copy_(torch.from_numpy(table))
        plan = pb.plan_cascade(table, lens, arena=arena, forest=prev, **kw)
        if arena is None:  # the first step: no arena yet, then one grown for it
            assert plan.arena is None
            arena = CascadeArena.grown_for(plan)
            plan = pb.plan_cascade(table, lens, arena=arena, **kw)
            first = plan
        assert plan.arena is arena and not plan.is_flat
        assert plan.partial_o.data_ptr() == arena.partial_o.data_ptr()
        assert all(plan.views[name].data_ptr() == arena.buffer[arena.offsets[name]:].data_ptr()
                   for name in arena.offsets)
        q = torch.randn(n, hq, d)
        bt, lens_t = torch.from_numpy(table), torch.from_numpy(lens).int()
        check_exact(q, k, v, bt, lens_t, plan, torch.float32)
        if plan.launch_key() == first.launch_key():
            same += 1
            if use_triton(q):  # (the torch path reads the plan's host arrays, not its buffers)
                check_exact(q, k, v, bt, lens_t, first, torch.float32)
        prev = plan
    assert same >= len(steps) // 2


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_that_outgrows_its_arena_fits_a_grown_one(seed):
    """A forest with more pieces than the arena has room for comes back outside it (``arena``
    None, fresh buffers, still exact); ``grown_for`` makes room for it and keeps the old room."""
    rng = np.random.default_rng(40 + seed)
    bs, hq, hkv, d = 4, 8, 2, 64
    small = random_forest(rng, bs, max_depth=1, max_requests=3, max_shared=2, min_requests=2)
    big = random_forest(rng, bs, max_depth=3, max_requests=24, max_shared=8, min_requests=16)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cpu", cost=KEEP_ALL)
    _, _, _, bt, lens = forest_inputs(rng, small, bs, hq, hkv, d, torch.float32)
    first = pb.plan_cascade(bt, lens, block_table_device=bt, **kw)
    arena = CascadeArena.grown_for(first)
    q, k, v, bt, lens = forest_inputs(rng, big, bs, hq, hkv, d, torch.float32)
    plan = pb.plan_cascade(bt, lens, block_table_device=bt, arena=arena, **kw)
    if plan.is_flat:
        return
    assert plan.arena is None and plan.buffers.data_ptr() != arena.buffer.data_ptr()
    check_exact(q, k, v, bt, lens, plan, torch.float32)
    grown = CascadeArena.grown_for(plan, arena)
    assert all(grown.capacity[name] >= arena.capacity[name] for name in arena.capacity)
    again = pb.plan_cascade(bt, lens, block_table_device=bt, arena=grown, **kw)
    assert again.arena is grown
    check_exact(q, k, v, bt, lens, again, torch.float32)


def test_a_grown_arena_keeps_the_parts_its_plan_lacks():
    """Growing an arena for a plan without some part (a plan of 64-row node tiles has no Hopper lists)
    keeps the old arena's room for it: a later plan of the other kind fits again, where it would
    otherwise grow the arena anew (and drop the graphs that read the old one)."""
    old = CascadeArena({"node_work": 64, "fused_prog_ptr": 96}, 8, 4, 64, "cpu")
    plan = SimpleNamespace(host={"node_work": np.zeros(200, np.int32), "slots": np.zeros(10, np.int32)},
                           num_slots=10, num_q_heads=8, num_kv_heads=2, head_dim=64, device=torch.device("cpu"))
    grown = CascadeArena.grown_for(plan, old)
    assert grown.capacity["fused_prog_ptr"] == 96 and grown.capacity["node_work"] >= 200
    assert grown.capacity["slots"] >= 10 and grown.slots >= 20


@pytest.mark.kernel
def test_a_copied_partition_sets_the_fold_tile():
    """A plan whose partition is copied from the last step's (only the tails grew) is the first of a
    fresh arena: it sets the arena's fold tile too, so a later plan there with other merge lists
    keeps its launch key."""
    bs, hq, hkv, d, n, width = 4, 8, 2, 64, 8, 16
    table = np.zeros((n, width), np.int32)
    table[:4, :5], table[4:, :3] = np.arange(5), 5 + np.arange(3)
    table[4:6, 3], table[6:, 3] = 8, 9  # lists of 3 for prompt B's samples
    private = 10 + np.arange(2 * n, dtype=np.int32).reshape(n, 2)
    table[:4, 5:7], table[4:, 4:6] = private[:4], private[4:]
    lens = np.array([7 * bs - 3] * 4 + [6 * bs - 2] * 4, np.int64)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cpu", cost=KEEP_ALL,
              block_table_device=torch.from_numpy(table.copy()))
    last = pb.plan_cascade(table, lens, **kw)
    arena = CascadeArena.grown_for(last)
    copied = pb.plan_cascade(table, lens + 1, forest=last, arena=arena, **kw)
    assert copied.arena is arena and arena.fold_len == copied.max_merge_len == 3
    table[4:], lens[4:] = 0, 0  # prompt B's samples finished: lists of 2
    later = pb.plan_cascade(table, lens + 2, arena=arena, **kw)
    assert later.arena is arena and later.launch_key() == copied.launch_key()


def test_arena_argument_checks():
    bt = torch.zeros(2, 4, dtype=torch.int32)
    kw = dict(num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=4, device="cpu")
    lens = np.array([9, 9])
    with pytest.raises(TypeError, match="arena must be a CascadeArena"):
        pb.plan_cascade(bt, lens, block_table_device=bt, arena=object(), **kw)
    arena = CascadeArena({"seq_lens": 8}, 4, 4, 64, "cpu")
    with pytest.raises(ValueError, match="arena needs block_table_device"):
        pb.plan_cascade(bt, lens, arena=arena, **kw)


def test_send_views_each_parts_entries():
    """``send`` copies the staged parts and views each part's first entries: views kept from the last
    send while the sizes stay (a steady step's), made anew when they change, never stale."""
    arena = CascadeArena({"a": 8, "b": 12}, 4, 4, 64, "cpu")
    views = []
    for step, sizes in enumerate([dict(a=3, b=5), dict(a=3, b=5), dict(a=6, b=5), dict(a=3, b=5)]):
        src, parts = arena.stage(sizes)
        for i, (name, part) in enumerate(parts.items()):
            part[:] = np.arange(part.size) + 100 * step + 10 * i
        views.append(arena.send(src, sizes))
        for i, (name, n) in enumerate(sizes.items()):
            assert views[-1][name].tolist() == list(range(100 * step + 10 * i, 100 * step + 10 * i + n))
    assert all(views[1][k] is views[0][k] for k in "ab") and views[2]["a"] is not views[1]["a"]
    views[1]["c"] = None  # (the caller's dict is its own)
    src, _ = arena.stage(dict(a=3, b=5))
    assert "c" not in arena.send(src, dict(a=3, b=5))


@pytest.mark.kernel
def test_a_forest_that_loses_requests_keeps_its_launches():
    """Two prompts' samples in one batch, then one prompt's samples finished (padding rows of length
    0, as in the engine's padded batches): the new forest has fewer node pieces and shorter merge lists
    but the same launch key (the kernels read the counts from the plan's lists; the fold loads as many
    states at once as the arena's first plan's longest list), and the first plan's launches - as the
    CUDA graph captured with it would replay them - give the new step's exact attention. The other way
    round too: an arena first planned with the short lists takes the longer ones in more rounds."""
    bs, hq, hkv, d, n, width = 4, 8, 2, 64, 8, 16
    table = np.zeros((n, width), np.int32)
    table[:4, :5], table[4:, :3] = np.arange(5), 5 + np.arange(3)  # prompt A: 5 shared blocks, B: 3
    table[4:6, 3], table[6:, 3] = 8, 9  # B's samples in two pairs sharing one block more: lists of 3
    private = 10 + np.arange(2 * n, dtype=np.int32).reshape(n, 2)
    table[:4, 5:7], table[4:, 4:6] = private[:4], private[4:]
    lens = np.array([7 * bs - 2] * 4 + [6 * bs - 1] * 4, np.int64)
    torch.manual_seed(0)
    k, v = torch.randn(10 + 2 * n, bs, hkv, d), torch.randn(10 + 2 * n, bs, hkv, d)
    table_dev, nested, nested_lens = torch.from_numpy(table.copy()), table.copy(), lens.copy()
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cpu", cost=KEEP_ALL,
              block_table_device=table_dev)
    arena = CascadeArena.grown_for(pb.plan_cascade(table, lens, **kw))
    first = pb.plan_cascade(table, lens, arena=arena, **kw)
    check_exact(torch.randn(n, hq, d), k, v, torch.from_numpy(table), torch.from_numpy(lens).int(), first,
                torch.float32)
    table[4:], lens[4:] = 0, 0  # prompt B's samples finished; A's decode one more token
    lens[:4] += 1
    table_dev.copy_(torch.from_numpy(table))
    plan = pb.plan_cascade(table, lens, arena=arena, **kw)
    assert plan.arena is arena and 0 < plan.num_node_pieces < first.num_node_pieces
    assert plan.launch_key() == first.launch_key()
    assert plan.max_merge_len == first.max_merge_len == 3  # (its own lists: 2 long)
    q, bt, lens_t = torch.randn(n, hq, d), torch.from_numpy(table), torch.from_numpy(lens).int()
    check_exact(q, k, v, bt, lens_t, plan, torch.float32)
    if use_triton(q):  # (the torch path reads the plan's host arrays, not its buffers)
        check_exact(q, k, v, bt, lens_t, first, torch.float32)
    short = CascadeArena.grown_for(first)  # (room for both forests; its first plan the short lists)
    before = pb.plan_cascade(table, lens, arena=short, **kw)
    table_dev.copy_(torch.from_numpy(nested))
    longer = pb.plan_cascade(nested, nested_lens, arena=short, **kw)
    assert longer.arena is short and longer.launch_key() == before.launch_key() and longer.max_merge_len == 2
    q, bt, lens_t = torch.randn(n, hq, d), torch.from_numpy(nested), torch.from_numpy(nested_lens).int()
    check_exact(q, k, v, bt, lens_t, longer, torch.float32)
    if use_triton(q):
        check_exact(q, k, v, bt, lens_t, before, torch.float32)


def _fixed_arena_steps(bs: int, n: int, width: int):
    """Steps of ``n`` rows, each a table [n, width] and lens [n], whose forests differ in every way a
    fixed arena must absorb: nothing shared; one prompt shared by all; two prompts; nodes nested three
    deep (more memberships than a fixed arena has room for: planned as tails only); padding rows of
    length 0 after one prompt's samples. -> [(name, table, lens)], blocks used."""
    rng = np.random.default_rng(7)
    nxt = iter(range(1, 10_000))
    lens = rng.integers(3 * bs + 1, 6 * bs, size=n)

    def private(table, row, start, end):
        for c in range(start, end):
            table[row, c] = next(nxt)

    def with_prefix(groups, depth_blocks):
        table = np.zeros((n, width), np.int32)
        for members, (lo, hi) in zip(groups, depth_blocks):
            ids = [next(nxt) for _ in range(lo, hi)]
            table[np.ix_(members, np.arange(lo, hi))] = ids
        for i in range(n):
            private(table, i, int(max((hi for g, (_, hi) in zip(groups, depth_blocks) if i in g), default=0)),
                    -(-int(lens[i]) // bs))
        return table

    half = [list(range(n // 2)), list(range(n // 2, n))]
    quarters = [list(range(i, i + n // 4)) for i in range(0, n, n // 4)]
    steps = [("distinct", with_prefix([], []), lens),
             ("one prompt", with_prefix([list(range(n))], [(0, 3)]), lens),
             ("two prompts", with_prefix(half, [(0, 2), (0, 3)]), lens),
             ("nested", with_prefix([list(range(n))] + half + quarters,
                                    [(0, 1)] + [(1, 2)] * 2 + [(2, 3)] * 4), lens)]
    pad = with_prefix([list(range(n // 2))], [(0, 3)])
    pad_lens = np.where(np.arange(n) < n // 2, lens, 0)
    pad[n // 2:] = 0
    steps.append(("padding rows", pad, pad_lens))
    return steps, next(nxt)


@pytest.mark.kernel
@pytest.mark.parametrize("bs,hq,hkv", [(4, 8, 2), (16, 4, 1)])
def test_a_fixed_arena_launches_alike_per_batch_size(bs, hq, hkv):
    """A fixed arena (``CascadeArena.for_graphs``: vLLM's full decode graphs, one per batch size): the
    plans of one batch size have one launch key whatever their forest - nothing shared (tails only, not
    a flat decode), one or two prompts, a forest too big for the arena's room (tails only), padding rows
    of length 0 - and the first plan's launches (as the CUDA graph captured with it replays) give each
    later step's exact attention. Another batch size has a key of its own in the same arena; a batch
    past the arena's rows is refused."""
    d, n, width = 64, 8, 8
    steps, nb = _fixed_arena_steps(bs, n, width)
    k, v = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    arena = CascadeArena.for_graphs(n, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, device="cpu")
    assert arena.fixed
    table_dev = torch.zeros(n, width, dtype=torch.int32)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cpu", cost=KEEP_ALL,
              block_table_device=table_dev, arena=arena)
    first, nodes = None, {}
    for name, table, lens in steps:
        table_dev.copy_(torch.from_numpy(table))
        plan = pb.plan_cascade(table, lens, **kw)
        nodes[name] = plan.num_nodes
        assert plan.arena is arena and not plan.is_flat and plan.launch_all, name
        # (an empty view's address is 0: a launch kept with it - a graph's - would read there)
        assert all(t.data_ptr() for t in plan.views.values()), name
        first = first or plan
        assert plan.launch_key() == first.launch_key(), name
        q, bt, lens_t = torch.randn(n, hq, d), torch.from_numpy(table), torch.from_numpy(lens).int()
        out, _ = check_exact(q, k, v, bt, lens_t, plan, torch.float32)
        assert not out[lens_t == 0].any()
        if use_triton(q):  # (the torch path reads the plan's host arrays, not its buffers)
            check_exact(q, k, v, bt, lens_t, first, torch.float32)
    assert nodes == {"distinct": 0, "one prompt": 1, "two prompts": 2, "nested": 0, "padding rows": 1}
    # a forest carried from a plan outside the arena (its own tile, lists) keeps the arena's launches
    _, table, lens = steps[2]
    table_dev.copy_(torch.from_numpy(table))
    eager = pb.plan_cascade(table, lens, **dict(kw, arena=None))
    eager.block_m = 16 if first.block_m != 16 else 32  # (as an eager plan's cost model may pick)
    carried = pb.plan_cascade(table, lens + 1, forest=eager, **kw)
    assert carried.num_nodes == 2 and carried.launch_key() == first.launch_key()
    check_exact(torch.randn(n, hq, d), k, v, torch.from_numpy(table), torch.from_numpy(lens + 1).int(), carried,
                torch.float32)
    small = pb.plan_cascade(steps[1][1][:3], steps[1][2][:3], **dict(kw, block_table_device=table_dev[:3]))
    assert small.arena is arena and small.launch_key() != first.launch_key() and small.launch_key()[0] == 3
    big = np.zeros((n + 1, width), np.int32)
    with pytest.raises(ValueError, match="does not fit the fixed arena"):
        pb.plan_cascade(big, np.full(n + 1, 1), **dict(kw, block_table_device=torch.from_numpy(big)))
