"""The merge lists of a cascade plan's partition (host numpy): for each ``(request, kv_head)``, the partial slots
the fold reads in order - its node slots (parents first, a node's pieces in token order), then its tail's - as
CSR ``req_ptr`` over ``slots`` (paged_backend/cascade/partition.py cuts the pieces and calls this).
"""
from __future__ import annotations

import numpy as np


def merge_lists(plan, h, kvh, mbase, n_in, nrb, seg0, seg, seg_ptr, cut_at, slot_base, mpb,
                 live, lseg, lseg_ptr, n_node_slots) -> np.ndarray:
    """Writes ``req_ptr`` and ``slots``; -> the list lengths ``[B * Hkv]``.

    A node's level is its place in each member's chain of nodes, so in a list the slots of a
    level-``l`` node follow one per level above, plus the extra pieces of cut segments above (a
    segment is one piece unless a program run ends in it). Each (membership, kv_head) takes its
    segment's first slot, the pieces after a cut the next positions; the tails' slots come last.
    (Row takes and broadcasts along the long axis: numpy is slowest along a short inner axis.)"""
    hkv, bsz = plan.num_kv_heads, plan.batch_size
    ptr, members, level = plan.node_ptr, plan.node_members, plan.node_level
    sizes = ptr[1:] - ptr[:-1]
    km = np.arange(sizes.size).repeat(sizes)  # [M] each membership's node
    lvm = level[km]
    count = np.bincount(members, minlength=bsz)  # node slots per list without cuts: one per level
    if lseg.size == live.size * hkv:  # one piece per tail
        count[live] += 1
        count = count.repeat(hkv)
    else:
        count = count.repeat(hkv)
        count.reshape(bsz, hkv)[live] += (lseg_ptr[1:] - lseg_ptr[:-1]).reshape(live.size, hkv)
    more = np.ones((int(level.max(initial=0)) + 1, 1), dtype=np.int64)  # [L, B * Hkv] node slots per level
    if cut_at.size:  # the pieces after a cut: a slot more for each member of their row block
        s = seg[cut_at]
        em, n = memberships(mbase[s], n_in[s])
        eh = kvh[s].repeat(n)
        more = more + np.bincount(lvm[em] * count.size + members[em] * hkv + eh,
                                  minlength=more.size * count.size).reshape(more.size, -1)
        count += more.sum(axis=0) - more.shape[0]
    rp = np.empty(count.size + 1, dtype=np.int64)  # req_ptr (int64: positions index with it)
    rp[0] = 0
    np.cumsum(count, out=rp[1:])
    h["req_ptr"][:] = rp
    # each list's first position per level: its start, then the slots of the levels above
    first = np.empty((more.shape[0], count.size), dtype=np.int64)
    first[0] = rp[:-1]
    for lv in range(1, first.shape[0]):
        np.add(first[lv - 1], more[lv - 1], out=first[lv])
    at = first.reshape(-1, hkv).take(lvm * bsz + members, axis=0)  # [M, Hkv]
    rbm, jm = np.divmod(np.arange(members.size) - ptr[km], mpb)
    heads = np.arange(hkv)[:, None]
    slots = h["slots"]
    slots[at.T] = slot_base[seg_ptr[:-1]][(seg0[km] + rbm) + heads * nrb[km]] + jm  # [Hkv, M]
    if cut_at.size:  # the pieces after a cut: the next positions of their members' lists
        pos = at.reshape(-1)[em * hkv + eh]
        pos += (cut_at - seg_ptr[s]).repeat(n)
        slots[pos] = (slot_base[cut_at] - mbase[s]).repeat(n) + em
    # tail slots: the last of each list, in piece order
    if lseg.size == live.size * hkv:  # one piece per tail
        last = rp[1:] if live.size == bsz else rp[1:].reshape(bsz, hkv)[live].reshape(-1)
        slots[last - 1] = np.arange(n_node_slots, n_node_slots + lseg.size)
    else:
        last = rp[1:].reshape(bsz, hkv)[live].reshape(-1) - lseg_ptr[1:]  # [live * Hkv]
        slots[last[lseg] + np.arange(lseg.size)] = np.arange(n_node_slots, n_node_slots + lseg.size)
    return count


def memberships(base: np.ndarray, n: np.ndarray):
    """The runs ``base[i] .. base[i] + n[i]`` end to end. -> (indices, n)."""
    return (base - np.cumsum(n) + n).repeat(n) + np.arange(int(n.sum())), n
