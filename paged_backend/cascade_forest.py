"""The prefix forest of a decode batch, found from its block tables (host numpy).

Requests share their leading *full* blocks when those hold the same block ids (a partially filled
last block is never shared). The forest is a compressed trie over the rows' full blocks, built top
down, one vectorised pass per tree level (a loop over levels only: none over blocks or requests):

1. rows whose first full block is held by another row are grouped by that block (one sort of
   one column); a group of >= 2 rows is a node candidate starting at column ``c = 0``;
2. each row of a group is compared against the group's *leader* (its smallest batch index),
   from ``c + 1`` on (:func:`lcp_with_leaders`): a probe row per group first, then the others
   one contiguous span each, up to where their probe differs (row spans read several times
   faster than narrow column chunks across rows; the rows that match all of it go on). The exact
   first mismatch (capped at both rows' full blocks) is the row's LCP with its leader, and the
   group's depth ``d`` is the smallest of them: every member holds the leader's ids on
   ``[c, d)``, compared id by id (no hashing, so nothing is shared on a collision);
3. members with a block at column ``d`` are sub-grouped by it (one sort of (group, id, row)
   packed into an int64); a sub-group of >= 2 rows is a child candidate starting at ``d``. The
   leader's own sub-group keeps its leader and the LCPs already measured (no column is read
   twice); the others take a new leader.

Nodes are folded by the cost model as they are produced (parents before children): a node's range
starts at its nearest *kept* ancestor's depth. ``auto_forest`` and ``group_forest`` return
``(members CSR ptr, members, start blk, end blk, level, kept depth per request)``, a node's level
being its kept ancestors (its place in each member's chain); nodes are parents first and each
node's members are ascending batch indices.
"""
from __future__ import annotations

import numpy as np

_CHUNK0 = 64          # columns a row reads at least, and the first chunk of a chunked scan
_BLOCK = 1 << 16      # ids compared per row block: the block's rows, its leaders and the mask stay in L2
_SPAN_MAX = 1 << 17   # ids below which rows read their whole range in one pass (chunks would not pay)


def _empty(bsz: int):
    z = np.zeros(0, np.int64)
    return np.zeros(1, np.int64), z, z, z.copy(), z.copy(), np.zeros(bsz, np.int64)


def _compare_block(table, rows, leads, c0: int, c1: int, out: np.ndarray) -> None:
    """``out[i]``: the offset from ``c0`` of the first column in ``[c0, c1)`` where ``table[rows[i]]``
    and its leader's row differ, else 0 (as for a mismatch at ``c0``: the caller tells them apart).
    ``leads``: one leader per row, or one int for all (its row read once)."""
    neq = table[rows, c0:c1] != table[leads, c0:c1]  # a fresh (contiguous) mask is the fastest to write
    neq.argmax(axis=1, out=out)  # stops at a row's first mismatch


def _first_mismatch(table: np.ndarray, rows: np.ndarray, leads: np.ndarray, a: np.ndarray,
                    b: np.ndarray, total: int) -> np.ndarray:
    """Per row: the first column in ``[a[i], b[i])`` where ``table[rows[i]]`` and
    ``table[leads[i]]`` differ, else ``b[i]``; ``total``: the sum of ``b - a``. Columns before
    ``a[i]`` must be known equal (a row block reads from its rows' smallest ``a``). Row blocks of
    ~_BLOCK ids, each row read as one contiguous span of its block's columns; rows whose ranges
    differ much go in order of ``b``, so that a block's columns stay close to each of its rows' own."""
    n, lo, hi = rows.size, int(a.min()), int(b.max())
    first = np.empty(n, dtype=np.intp)
    order = None
    if (hi - lo) * n <= 1.25 * total:  # about one range: compare all rows over it
        if leads[0] == leads[-1] and (leads == leads[0]).all():
            leads = int(leads[0])  # one leader: its row read once, broadcast
        step = max(1, _BLOCK // (hi - lo))
        for i in range(0, n, step):
            _compare_block(table, rows[i:i + step], leads if isinstance(leads, int) else leads[i:i + step],
                           lo, hi, first[i:i + step])
        first += lo
    else:
        order = np.argsort(b, kind="stable")
        rows, leads, a, b = rows[order], leads[order], a[order], b[order]
        cum = np.cumsum(b - a)
        edges = np.unique(np.searchsorted(cum, np.arange(0, total, _BLOCK), side="right").tolist() + [0, n])
        x0, x1 = np.minimum.reduceat(a, edges[:-1]), b[edges[1:] - 1]  # each block's columns
        edges = edges.tolist()
        for i0, i1, c0, c1 in zip(edges[:-1], edges[1:], x0.tolist(), x1.tolist()):
            _compare_block(table, rows[i0:i1], leads[i0:i1], c0, c1, first[i0:i1])
        first += np.repeat(x0, np.diff(edges))
    # argmax also names a block's first column where a row has no mismatch: equal there, it has none
    out = np.where((first < b) & (table[rows, first] != table[leads, first]), first, b)
    if order is not None:
        out[order] = out.copy()
    return out


def lcp_with_leaders(table: np.ndarray, rows: np.ndarray, leads: np.ndarray, start: np.ndarray,
                     cap: np.ndarray) -> np.ndarray:
    """First column ``j`` in ``[start[i], cap[i])`` where ``table[rows[i], j] != table[leads[i], j]``,
    else ``cap[i]``; columns before ``start[i]`` must already be known equal. Exact: id by id.

    Reading whole row spans in one pass is several times faster than narrow column chunks across
    the rows, so: few ids -> one pass over each row's range. Else each run of rows with the same
    leader (callers pass rows grouped by leader) sends its middle row ahead as a probe; the others
    read one span up to and including the column where their probe differs (where the run most
    likely ends, at least _CHUNK0 columns), and the rows that match all of it go on the same way.
    Rows that each have their own leader scan in chunks of 64, 256, 1024, ... columns. A run whose
    probe shares far more than its other rows reads past their LCPs (at worst up to the probe's)."""
    start, cap = np.asarray(start, dtype=np.int64), np.asarray(cap, dtype=np.int64)
    todo = (cap > start).nonzero()[0]
    if todo.size == cap.size:
        return _lcp(table, rows, leads, start, cap)
    e = cap.copy()
    if todo.size:
        e[todo] = _lcp(table, rows[todo], leads[todo], start[todo], cap[todo])
    return e


def _lcp(table, rows, leads, a, b):
    """``lcp_with_leaders`` of rows whose ranges ``[a, b)`` are not empty."""
    total = int((b - a).sum())
    if total <= _SPAN_MAX:
        return _first_mismatch(table, rows, leads, a, b, total)
    new = np.empty(rows.size, dtype=bool)
    new[0] = True
    np.not_equal(leads[1:], leads[:-1], out=new[1:])
    rs = new.nonzero()[0]  # each run's first row
    if rs.size == rows.size:  # every row has its own leader: chunks
        e = b.copy()
        todo, w = np.arange(rows.size), _CHUNK0
        while todo.size:
            end = np.minimum(a + w, b)
            e[todo] = f = _first_mismatch(table, rows, leads, a, end, int((end - a).sum()))
            go = ((f == end) & (end < b)).nonzero()[0]
            todo, rows, leads, a, b, w = todo[go], rows[go], leads[go], end[go], b[go], 4 * w
        return e
    runs = np.empty_like(rs)
    runs[:-1] = rs[1:] - rs[:-1]
    runs[-1] = rows.size - rs[-1]
    mid = rs + runs // 2
    e = np.empty(rows.size, dtype=np.int64)
    e[mid] = pe = _lcp(table, rows[mid], leads[mid], a[mid], b[mid])
    new[:] = True
    new[mid] = False
    rest = new.nonzero()[0]  # the others, runs - 1 of each run
    ar, br = a[rest], b[rest]
    bound = np.minimum(np.maximum(pe.repeat(runs - 1) + 1, ar + _CHUNK0), br)
    f = _first_mismatch(table, rows[rest], leads[rest], ar, bound, int((bound - ar).sum()))
    more = ((f == bound) & (bound < br)).nonzero()[0]  # matched all of their span: go on from its end
    if more.size:
        m = rest[more]
        f[more] = _lcp(table, rows[m], leads[m], bound[more], br[more])
    e[rest] = f
    return e


def _subgroups(gid, key: np.ndarray):
    """Runs of equal (gid, key) with >= 2 rows, stable (rows keep their order); ``gid`` ascends
    (None: one group). -> (positions into the inputs, sub-group starts, sub-group sizes)."""
    n = key.size
    pb = (n - 1).bit_length()
    gb = int(gid[-1]).bit_length() if gid is not None else 0
    small = key.dtype.itemsize <= 4
    lo = (-(1 << 31) if key.dtype.kind == "i" else 0) if small else int(key.min())
    if gb + pb <= 31 and (small or (key.dtype.kind == "i" and int(key.max()) - lo < 1 << 32)):
        # (gid, key, position) in one int64: an unstable sort of distinct values keeps the order
        s = key.astype(np.int64)
        s -= lo
        s <<= pb
        s |= np.arange(n)
        if gid is not None:
            s |= gid << (32 + pb)
        s.sort()
        o = s & ((1 << pb) - 1)
        s >>= pb
        same = s[1:] == s[:-1]  # [n - 1] as the previous row
    else:
        o = key.argsort(kind="stable") if gid is None else np.lexsort((key, gid))
        k = key[o]
        same = k[1:] == k[:-1]
        if gid is not None:
            g = gid[o]
            same &= g[1:] == g[:-1]
    keep = np.zeros(n, dtype=bool)
    keep[1:] = same
    keep[:-1] |= same
    head = keep.copy()  # a kept run's first row: kept, and not as the previous row
    np.greater(keep[1:], same, out=head[1:])
    o = o[keep]
    starts = head[keep].nonzero()[0]
    sizes = np.empty_like(starts)
    sizes[:-1] = starts[1:] - starts[:-1]
    sizes[-1:] = o.size - starts[-1:]
    return o, starts, sizes


def auto_forest(table: np.ndarray, full: np.ndarray, pays):
    """The prefix forest of ``table``'s rows over their first ``full`` blocks, folded by ``pays``."""
    bsz = full.size
    cand = (full > 0).nonzero()[0]
    if cand.size < 2:
        return _empty(bsz)
    # level 0: group by the first block (cand is ascending, the sort is stable)
    o, gstart, n = _subgroups(None, table[cand, 0])
    if not gstart.size:
        return _empty(bsz)  # no two rows share a first block: flat, without reading further
    rows = cand[o]
    gid = np.arange(gstart.size).repeat(n)  # [R] each row's group
    c = np.zeros(gstart.size, dtype=np.int64)   # [G] first column of each group's own range
    e = np.full(rows.size, -1, dtype=np.int64)  # [R] LCP with the group's leader, -1: not measured
    kd = np.zeros(bsz, dtype=np.int64)           # kept depth per request
    kc = np.zeros(bsz, dtype=np.int64)           # kept nodes per request
    fr = full[rows]
    ptr_parts, mem_parts, start_parts, end_parts, level_parts = [], [], [], [], []
    while True:
        lead, flead = rows[gstart], fr[gstart]
        e[gstart] = flead
        t = (e < 0).nonzero()[0]
        if t.size:
            g = gid[t]
            e[t] = lcp_with_leaders(table, rows[t], lead[g], c[g] + 1, np.minimum(fr[t], flead[g]))
        d = np.minimum.reduceat(e, gstart)
        dg = d[gid]
        pk = kd[lead]
        keep = pays(n, d - pk)
        if keep.any():
            el = keep[gid]
            m = rows[el]
            kd[m] = dg[el]
            ptr_parts.append(n[keep])
            mem_parts.append(m)
            start_parts.append(pk[keep])
            end_parts.append(d[keep])
            level_parts.append(kc[lead[keep]])
            kc[m] += 1
        # children: members with a block at their group's depth, sub-grouped by it
        live = (fr > dg).nonzero()[0]
        if live.size < 2:
            break
        rl = rows[live]
        o, gstart, n = _subgroups(gid[live], table[rl, dg[live]])
        if not gstart.size:
            break
        p = live[o]
        rows, fr, ep, dp = rl[o], fr[p], e[p], dg[p]
        c = dp[gstart]
        gid = np.arange(gstart.size).repeat(n)
        e = np.where(ep > dp, ep, -1)  # in the leader's sub-group: the measured LCP stays valid
    if not ptr_parts:
        return _empty(bsz)[:5] + (kd,)
    sizes = np.concatenate(ptr_parts)
    ptr = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    return (ptr, np.concatenate(mem_parts), np.concatenate(start_parts).astype(np.int64),
            np.concatenate(end_parts).astype(np.int64), np.concatenate(level_parts), kd)


def group_forest(table: np.ndarray, full: np.ndarray, groups, pays):
    """Explicit (laminar) groups from the scheduler; each is verified: only the blocks common to
    all its members are shared."""
    bsz = full.size
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"groups must be a list of lists of batch indices, got {type(groups).__name__}")
    gs = []
    for i, g in enumerate(groups):
        arr = np.asarray(g)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"groups[{i}] must be a 1-D list of integer batch indices")
        arr = arr.astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= bsz):
            raise ValueError(f"groups[{i}] holds batch indices outside [0, {bsz})")
        if np.unique(arr).size != arr.size:
            raise ValueError(f"groups[{i}] repeats a batch index")
        gs.append(arr)
    owner = np.full(bsz, -1, dtype=np.int64)
    kd = np.zeros(bsz, dtype=np.int64)
    kc = np.zeros(bsz, dtype=np.int64)  # kept nodes per request
    ptr, members, starts, ends, levels = [0], [], [], [], []
    for gi in sorted(range(len(gs)), key=lambda i: -gs[i].size):  # parents before children
        g = gs[gi]
        if g.size == 0:
            continue
        if np.unique(owner[g]).size != 1:
            raise ValueError(f"groups must nest or be disjoint; groups[{gi}] straddles another group")
        owner[g] = gi
        cap = int(full[g].min())
        depth = cap
        if g.size > 1 and cap > 0:
            lead = np.full(g.size - 1, g[0])
            depth = int(lcp_with_leaders(table, g[1:], lead, np.full(g.size - 1, kd[g[0]]),
                                         np.full(g.size - 1, cap)).min())
        pk = int(kd[g[0]])
        if g.size < 2 or depth <= pk or not pays(np.array([g.size]), np.array([depth - pk]))[0]:
            continue
        kd[g] = depth
        members.append(np.sort(g))
        ptr.append(ptr[-1] + g.size)
        starts.append(pk)
        ends.append(depth)
        levels.append(int(kc[g[0]]))
        kc[g] += 1
    if not members:
        return _empty(bsz)[:5] + (kd,)
    return (np.asarray(ptr, np.int64), np.concatenate(members), np.asarray(starts, np.int64),
            np.asarray(ends, np.int64), np.asarray(levels, np.int64), kd)
