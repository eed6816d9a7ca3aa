"""Cascade (shared-prefix) decode: the prefix forest found from block tables, and exactness of
``pb.cascade_decode`` against the dense reference on random forests (depth 1-4, shuffled batch)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.kernels.dispatch import INTERPRET
from paged_backend.cascade.forest import auto_forest
from paged_backend.cascade.plan import CascadeCost
from tests.paged_inputs import make_cache
from tests.reference import assert_close_state, decode_reference

pytestmark = pytest.mark.kernel
KEEP_ALL = CascadeCost(0, 0, 0)  # every shared block pays off: exercises every node


def random_forest(rng, bs: int, max_depth: int, max_requests: int = 12, max_shared: int = 2,
                  max_children: int = 3, min_requests: int = 1):
    """-> (full-block label lists, partial tokens) per request. Each node has a shared run of
    0-``max_shared`` blocks (0 = an empty run), 1-``max_children`` children; leaves get 0-2 private
    full blocks and 0..bs-1 tokens of a partial block. Labels are logical block ids; shared blocks
    share labels."""
    reqs = []
    nxt = [0]

    def new(n):
        out = list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        return out

    def node(prefix, depth):
        blocks = prefix + new(int(rng.integers(0, max_shared + 1)))
        for _ in range(int(rng.integers(1, max_children + 1))):
            if len(reqs) >= max_requests:
                return
            if depth < max_depth and rng.random() < 0.6:
                node(blocks, depth + 1)
            else:
                reqs.append((blocks + new(int(rng.integers(0, 3))), int(rng.integers(0, bs))))

    while len(reqs) < min_requests:
        node([], 1)
    return reqs


def forest_inputs(rng, reqs, bs, hq, hkv, d, dtype, shuffle=True):
    """Physical block table (labels -> shuffled physical ids; partial blocks private), lengths,
    q and caches; the batch order is shuffled."""
    order = rng.permutation(len(reqs)) if shuffle else np.arange(len(reqs))
    reqs = [reqs[i] for i in order]
    n_labels = 1 + max([max(b) for b, _ in reqs if b] + [0])
    n_partial = sum(1 for _, p in reqs if p)
    nb = n_labels + n_partial + 2
    phys = rng.permutation(nb)
    cols = max(len(b) + (p > 0) for b, p in reqs) + 1
    table = rng.integers(0, nb, size=(len(reqs), cols)).astype(np.int32)  # garbage beyond use
    lens = []
    at = n_labels
    for i, (b, p) in enumerate(reqs):
        row = [int(phys[x]) for x in b]
        if p:
            row.append(int(phys[at]))
            at += 1
        table[i, :len(row)] = row
        lens.append(len(b) * bs + p)
    k, v = make_cache(nb, bs, hkv, d, dtype)
    q = torch.randn(len(reqs), hq, d).to(dtype)
    return q, k, v, torch.from_numpy(table), torch.tensor(lens, dtype=torch.int32)


def true_lcp_blocks(table, lens, bs):
    """Pairwise LCP over full blocks, with plain Python loops."""
    t = table.tolist()
    full = [int(n) // bs for n in lens.tolist()]
    bsz = len(full)
    out = np.zeros((bsz, bsz), dtype=np.int64)
    for i in range(bsz):
        for j in range(bsz):
            c = 0
            while c < min(full[i], full[j]) and t[i][c] == t[j][c]:
                c += 1
            out[i, j] = c
    return out


def check_exact(q, k, v, bt, lens, cplan, dtype):
    out, lse = pb.cascade_decode(q, k, v, cplan)
    ref_o, ref_l = decode_reference(q, k, v, bt, lens)
    assert_close_state(out, lse, ref_o, ref_l, dtype)
    return out, lse


DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_forest_exact(seed, dtype):
    rng = np.random.default_rng(seed)
    bs = [4, 16, 4, 16, 64, 4][seed]
    hq, hkv = [(4, 4), (8, 2), (8, 1), (16, 2), (4, 1), (8, 8)][seed]
    reqs = random_forest(rng, bs, max_depth=1 + seed % 4, max_requests=10)
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, hq, hkv, 64, dtype)
    cplan = pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=bs,
                            device="cpu", cost=KEEP_ALL)
    check_exact(q, k, v, bt, lens, cplan, dtype)


@pytest.mark.parametrize("seed", range(40))
def test_forest_equals_true_sharing(seed):
    rng = np.random.default_rng(1000 + seed)
    bs = [1, 4, 16][seed % 3]
    reqs = random_forest(rng, bs, max_depth=1 + seed % 4, max_requests=16)
    _, _, _, bt, lens = forest_inputs(rng, reqs, bs, 4, 4, 64, torch.float32)
    cplan = pb.plan_cascade(bt, lens, num_q_heads=4, num_kv_heads=4, head_dim=64, block_size=bs,
                            device="cpu", cost=KEEP_ALL)
    lcp = true_lcp_blocks(bt, lens, bs)
    bsz = lens.numel()
    deepest = np.zeros((bsz, bsz), dtype=np.int64)
    chain_end = np.zeros(bsz, dtype=np.int64)
    for members, t0, t1 in cplan.nodes():
        assert members.size >= 2 and t1 > t0 and t0 % bs == 0 and t1 % bs == 0
        for m in members:  # each request's node ranges tile [0, shared_len) parent first
            assert chain_end[m] == t0
            chain_end[m] = t1
        ix = np.ix_(members, members)
        deepest[ix] = np.maximum(deepest[ix], t1)
    np.fill_diagonal(lcp, 0)
    np.fill_diagonal(deepest, 0)
    assert np.array_equal(deepest, lcp * bs)
    assert np.array_equal(chain_end, cplan.shared_len_host)
    assert np.array_equal(cplan.shared_len_host, lcp.max(axis=1, initial=0) * bs)


@pytest.mark.parametrize("seed", range(8))
def test_forest_long_runs_equals_true_sharing(seed):
    """Shared runs of up to 700 blocks (several compare chunks), up to 5 levels, many rows per
    group and the batch shuffled; int32 and int64 tables. Checks the kept depth of every request
    and every node against pairwise LCPs."""
    rng = np.random.default_rng(2000 + seed)
    reqs, nxt = [], [0]

    def run():
        n = int(rng.choice([0, 1, 2, int(rng.integers(30, 700))]))
        nxt[0] += n
        return list(range(nxt[0] - n, nxt[0]))

    def node(prefix, depth):
        blocks = prefix + run()
        for _ in range(int(rng.integers(1, 8))):
            if len(reqs) >= 60:
                return
            if depth < 5 and rng.random() < 0.5:
                node(blocks, depth + 1)
            else:
                reqs.append(blocks + run())

    while len(reqs) < 2:
        node([], 1)
    reqs = [reqs[i] for i in rng.permutation(len(reqs))]
    phys = rng.permutation(nxt[0] + 8)
    table = rng.integers(0, nxt[0] + 8, size=(len(reqs), max(map(len, reqs)) + 2))
    table = table.astype(np.int64 if seed % 2 else np.int32)
    for i, b in enumerate(reqs):
        table[i, :len(b)] = phys[b]
    full = np.array([max(0, len(b) - int(rng.integers(0, 2))) for b in reqs])
    bsz = full.size
    lcp = np.zeros((bsz, bsz), dtype=np.int64)
    for i in range(bsz):
        for j in range(bsz):
            if i != j:
                m = min(full[i], full[j])
                neq = table[i, :m] != table[j, :m]
                lcp[i, j] = neq.argmax() if neq.any() else m
    ptr, members, start, end, level, kd = auto_forest(table, full, lambda n, own: np.ones(np.shape(n), dtype=bool))
    assert np.array_equal(kd, lcp.max(axis=1, initial=0))
    chain, place = np.zeros(bsz, dtype=np.int64), np.zeros(bsz, dtype=np.int64)
    for k in range(start.size):
        m = members[ptr[k]:ptr[k + 1]]
        assert m.size >= 2 and np.all(np.diff(m) > 0) and np.all(chain[m] == start[k])
        assert np.all(place[m] == level[k])  # the node's place in each member's chain
        chain[m] = end[k]
        place[m] += 1
        sub = lcp[np.ix_(m, m)] + np.diag(np.full(m.size, 1 << 40))
        assert sub.min() == end[k]  # the members' common prefix ...
        out = np.setdiff1d(np.arange(bsz), m)
        assert out.size == 0 or lcp[np.ix_(m, out)].max() < end[k]  # ... and no one else has it


def test_many_samples_take_256_row_tiles():
    """100 samples x a group of 4 = 400 rows: 256-row node tiles (16 warps on a GPU) where the GEMM
    is long enough; two row blocks, the second partial; a second node of 2 samples in the same launch."""
    rng = np.random.default_rng(13)
    bs, hq, hkv = 16, 8, 2
    reqs = [([0, 1, 2], int(rng.integers(0, bs))) for _ in range(100)] + [([3, 4], 5), ([3, 4, 5], 0)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, hq, hkv, 64, torch.float32)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=bs, device="cpu")
    assert pb.plan_cascade(bt, lens, **kw, cost=KEEP_ALL).block_m == 128  # a short GEMM: 128-row tiles
    cplan = pb.plan_cascade(bt, lens, **kw, cost=CascadeCost(0, 0, 0, wide_tile_flops=0))
    assert cplan.block_m == 256 and cplan.num_nodes == 2
    check_exact(q, k, v, bt, lens, cplan, torch.float32)


def test_groups_verified_and_nested():
    rng = np.random.default_rng(7)
    bs, hq, hkv = 4, 4, 2
    # system prompt (2 blocks) shared by 6; prompts of 1-2 blocks shared by 3; 1 private block each
    reqs = [([0, 1, 2, 3], 1), ([0, 1, 2, 3, 4], 0), ([0, 1, 2, 3, 5], 2),
            ([0, 1, 6, 7], 3), ([0, 1, 6, 7, 8], 0), ([0, 1, 6, 9], 1)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, hq, hkv, 64, torch.float32, shuffle=False)
    groups = [[0, 1, 2, 3, 4, 5], [2, 0, 1], [3, 4, 5]]
    cplan = pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=bs,
                            device="cpu", groups=groups, cost=KEEP_ALL)
    got = sorted((tuple(sorted(m.tolist())), a, b) for m, a, b in cplan.nodes())
    # group [3, 4, 5] only verifies 3 common blocks: request 5 diverges at block 3
    assert got == [((0, 1, 2), 2 * bs, 4 * bs), ((0, 1, 2, 3, 4, 5), 0, 2 * bs), ((3, 4, 5), 2 * bs, 3 * bs)]
    check_exact(q, k, v, bt, lens, cplan, torch.float32)
    with pytest.raises(ValueError, match="groups"):
        pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=bs, device="cpu",
                        groups=[[0, 1, 2], [2, 3]])
    with pytest.raises(ValueError, match="groups"):
        pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=bs, device="cpu",
                        groups=[[0, 9]])


def test_cost_model_folds_and_falls_back_to_flat():
    rng = np.random.default_rng(3)
    bs = 16
    reqs = [([0, 1], 5), ([0, 1, 2], 3), ([0, 4], 7), ([9], 0), ([], 0)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, 8, 2, 64, torch.float32)
    cplan = pb.plan_cascade(bt, lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs, device="cpu")
    assert cplan.is_flat  # a few shared blocks do not pay for the extra launches
    out, lse = check_exact(q, k, v, bt, lens, cplan, torch.float32)
    empty = lens == 0
    assert torch.all(out[empty] == 0) and torch.all(torch.isneginf(lse[empty]))
    # a big saving per node, but a tiny node (n = 2, one block) is folded into its children
    cost = CascadeCost(state_passes=0, node_fixed_bytes=3 * bs * 2 * 64 * 2 * 2, min_total_bytes=0)
    reqs = [([0, 1, 2, 3, 4], 1), ([0, 1, 2, 3, 4], 2), ([0, 1, 2, 3, 4, 5], 1), ([0, 6], 3), ([0, 6], 2)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, 8, 2, 64, torch.float32, shuffle=False)
    cplan = pb.plan_cascade(bt, lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs,
                            device="cpu", cost=cost)
    got = sorted((tuple(sorted(m.tolist())), a, b) for m, a, b in cplan.nodes())
    # root (block 0, n=5) pays; [0, 6] (one more block, n=2) does not; [0..4] (4 more, n=3) pays
    assert got == [((0, 1, 2), bs, 5 * bs), ((0, 1, 2, 3, 4), 0, bs)]
    assert cplan.shared_len_host.tolist() == [5 * bs, 5 * bs, 5 * bs, bs, bs]
    check_exact(q, k, v, bt, lens, cplan, torch.float32)


@pytest.mark.parametrize("bs", [16, 64])
def test_empty_and_whole_shared_requests(bs):
    rng = np.random.default_rng(11)
    # two requests identical and block aligned (no private tail at all), zero-length requests
    reqs = [([0, 1], 0), ([0, 1], 0), ([], 0), ([0, 1, 2], 0), ([], 0)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, 4, 1, 64, torch.float16)
    cplan = pb.plan_cascade(bt, lens, num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=bs, device="cpu",
                            cost=KEEP_ALL)
    assert cplan.num_nodes == 1 and cplan.shared_len_host.tolist().count(2 * bs) == 3
    out, lse = check_exact(q, k, v, bt, lens, cplan, torch.float16)
    empty = lens == 0
    assert torch.all(out[empty] == 0) and torch.all(torch.isneginf(lse[empty]))
    out2, lse2 = pb.cascade_decode(q, k, v, cplan)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)  # deterministic


def test_vllm_strided_cache_and_scale():
    rng = np.random.default_rng(5)
    bs, hq, hkv = 16, 8, 2
    reqs = [([0, 1, 2], 3), ([0, 1, 2], 9), ([0, 1, 4], 1), ([0, 5], 0)]
    q, _, _, bt, lens = forest_inputs(rng, reqs, bs, hq, hkv, 64, torch.float32)
    nb = int(bt.max()) + 1
    k, v = make_cache(nb, bs, hkv, 64, torch.float32, layout="vllm")
    cplan = pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=bs,
                            device="cpu", cost=KEEP_ALL)
    out, lse = pb.cascade_decode(q, k, v, cplan, scale=0.3)
    ref_o, ref_l = decode_reference(q, k, v, bt, lens, scale=0.3)
    assert_close_state(out, lse, ref_o, ref_l, torch.float32)
    assert torch.equal(pb.cascade_decode(q, k, v, cplan, scale=0.3, return_lse=False), out)


def test_argument_validation():
    rng = np.random.default_rng(2)
    reqs = [([0, 1], 1), ([0, 1], 2)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, 4, 4, 2, 64, torch.float32)
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="block_table_cpu"):
        pb.plan_cascade(bt[0], lens, **kw)
    with pytest.raises(TypeError, match="seq_lens_cpu"):
        pb.plan_cascade(bt, lens.float(), **kw)
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        pb.plan_cascade(bt, lens * 100, **kw)
    with pytest.raises(ValueError, match="head_dim"):
        pb.plan_cascade(bt, lens, **{**kw, "head_dim": 65})
    with pytest.raises(ValueError, match="block_size"):
        pb.plan_cascade(bt, lens, **{**kw, "block_size": 3})
    with pytest.raises(ValueError, match="q heads"):
        pb.plan_cascade(bt, lens, **{**kw, "num_q_heads": 3})
    with pytest.raises(TypeError, match="cost"):
        pb.plan_cascade(bt, lens, **kw, cost=1.0)
    cplan = pb.plan_cascade(bt, lens, **kw, cost=KEEP_ALL)
    with pytest.raises(TypeError, match="cplan"):
        pb.cascade_decode(q, k, v, "plan")
    with pytest.raises(ValueError, match="cplan.batch_size"):
        pb.cascade_decode(q[:1], k, v, cplan)
    with pytest.raises(TypeError, match="q dtype"):
        pb.cascade_decode(q.half(), k, v, cplan)
    with pytest.raises(ValueError, match="cplan.num_q_heads"):
        pb.cascade_decode(torch.cat([q, q], 1), k, v, cplan)
    with pytest.raises(ValueError, match="scale"):
        pb.cascade_decode(q, k, v, cplan, scale=-1.0)
    with pytest.raises(ValueError, match="block id"):
        pb.cascade_decode(q, k[:1], v[:1], cplan)


def plan_time_table(rng, bsz=1024, width=2048):
    """64 prompts x 16 samples sharing 1536 blocks, under a 128-block system prompt shared by all;
    512 private blocks each; the batch order shuffled."""
    table = rng.permutation(4 * bsz * width)[: bsz * width].reshape(bsz, width).astype(np.int32)
    for g in range(64):
        table[g * 16:(g + 1) * 16, :1536] = table[g * 16, :1536]
    table[:, :128] = table[0, :128]  # a system prompt shared by all
    return np.ascontiguousarray(table[rng.permutation(bsz)])


def test_plan_time_1024_requests_2k_blocks():
    """plan_cascade on 1024 requests x 2048 blocks with the table already on the device: the
    2-level forest (65 nodes), 1024 unrelated requests (flat at once) and 128 groups x 8."""
    rng = np.random.default_rng(0)
    bsz, width, bs = 1024, 2048, 16
    lens = np.full(bsz, width * bs - 5)
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=bs, device="cpu")
    unrelated = rng.permutation(4 * bsz * width)[: bsz * width].reshape(bsz, width).astype(np.int32)
    groups = unrelated.copy()
    for g in range(128):
        groups[g * 8:(g + 1) * 8, :1024] = groups[g * 8, :1024]
    groups = np.ascontiguousarray(groups[rng.permutation(bsz)])
    for name, table, nodes in (("64x16 + system prompt", plan_time_table(rng), 65), ("unrelated", unrelated, 0),
                               ("128x8", groups, 128)):
        bt_dev = torch.from_numpy(table)
        pb.plan_cascade(table, lens, **kw, block_table_device=bt_dev)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            cplan = pb.plan_cascade(table, lens, **kw, block_table_device=bt_dev)
            times.append(time.perf_counter() - t0)
        assert cplan.num_nodes == nodes
        if nodes:
            assert np.all(cplan.shared_len_host == (1536 if nodes == 65 else 1024) * bs)
        print(f"plan_cascade 1024 x 2048 blocks, {name}: median {np.median(times) * 1e3:.2f} ms, "
              f"min {min(times) * 1e3:.2f} ms")
        if nodes:  # the 1 ms target is measured by benchmarks/bench_cascade.py; this only catches
            # a return to per-block Python loops (hundreds of ms) on a shared 2-core CI machine
            assert min(times) < 0.05
    # unrelated requests: the forest is found empty from one column (the flat plan's own cost,
    # plan_decode, is tested with decode)
    full = lens // bs
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        ptr = auto_forest(unrelated, full, lambda n, own: np.ones(np.shape(n), dtype=bool))[0]
        times.append(time.perf_counter() - t0)
    assert ptr.size == 1
    print(f"prefix forest of 1024 unrelated requests: min {min(times) * 1e6:.0f} us")
    assert min(times) < 0.01  # ~60 us measured; generous for a loaded CI machine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix,n,suffix", [(4096, 16, 300), (1000, 64, 17), (160, 3, 0)])
def test_gpu_shared_prefix_exact_and_graph_replay(dtype, prefix, n, suffix):
    bs, hq, hkv, d = 16, 32, 8, 128
    rng = np.random.default_rng(prefix + n)
    shared = prefix // bs  # only full blocks are shared
    nb = shared + n * (-(-(prefix + suffix) // bs) - shared) + 4
    perm = rng.permutation(nb).astype(np.int32)
    cols = -(-(prefix + suffix) // bs)
    table = np.zeros((n, cols), dtype=np.int32)
    table[:, :shared] = perm[:shared]
    table[:, shared:] = perm[shared: shared + n * (cols - shared)].reshape(n, cols - shared)
    lens = np.full(n, prefix + suffix, dtype=np.int64)
    k, v = make_cache(nb, bs, hkv, d, dtype, device="cuda", layout="vllm")
    q = torch.randn(n, hq, d, device="cuda").to(dtype)
    bt = torch.from_numpy(table).cuda()
    sl = torch.from_numpy(lens.astype(np.int32)).cuda()
    cplan = pb.plan_cascade(table, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            device="cuda", cost=KEEP_ALL, block_table_device=bt)
    assert shared == 0 or not cplan.is_flat
    out, lse = pb.cascade_decode(q, k, v, cplan)
    ref_o, ref_l = decode_reference(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), sl.cpu())
    assert_close_state(out, lse, ref_o, ref_l, dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = pb.cascade_decode(q, k, v, cplan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
