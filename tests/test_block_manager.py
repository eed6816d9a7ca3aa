"""BlockManager: unit tests and a hypothesis state machine over add/fork/append/free/preempt.

A fake KV cache stores, per slot, the (token id, position) written there; a sequence reads its
KV correctly iff gathering its block table gives back its own tokens and positions. That catches
wrong prefix-cache sharing, missed copy-on-write copies and writes into shared blocks.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from paged_backend.scheduler import BlockManager, Sequence

NB, BS = 48, 4
STEPS = {"n": 0}


class FakeKV:
    def __init__(self, nb, bs):
        self.bs = bs
        self.tok = np.full(nb * bs, -1, np.int64)
        self.pos = np.full(nb * bs, -1, np.int64)

    def copy(self, src, dst):
        bs = self.bs
        self.tok[dst * bs:(dst + 1) * bs] = self.tok[src * bs:(src + 1) * bs]
        self.pos[dst * bs:(dst + 1) * bs] = self.pos[src * bs:(src + 1) * bs]

    def write(self, slots, toks, pos):
        self.tok[slots] = toks
        self.pos[slots] = pos

    def read_ok(self, bm, seq, n):
        p = np.arange(n)
        slots = np.asarray(seq.block_table, np.int64)[p // self.bs] * self.bs + p % self.bs
        return (np.array_equal(self.tok[slots], seq.token_ids[:n])
                and np.array_equal(self.pos[slots], p))


def check_writes(bm, live, writer, slots):
    """No two live sequences own the same writable slot: every other holder of a block written
    by ``writer`` has that whole block inside its computed (read-only) prefix, i.e. it is a
    resumed sample waiting for its leader to fill the shared prompt blocks."""
    bs = bm.block_size
    for b in set((np.asarray(slots) // bs).tolist()):
        if bm.ref[b] == 1:
            assert b in writer.block_table
            continue
        for h in live:
            if h is not writer and b in h.block_table:
                assert (h.block_table.index(b) + 1) * bs <= h.num_computed_tokens, \
                    f"seq {writer.seq_id} writes block {b} that seq {h.seq_id} may also write"


def compute(bm, kv, seq, live=()):
    """Prefill seq's uncomputed tokens and mark them computed."""
    a, e = seq.num_computed_tokens, len(seq.token_ids)
    slots = bm.slots(seq, a, e)
    check_writes(bm, live, seq, slots)
    kv.write(slots, seq.token_ids[a:e], np.arange(a, e))
    bm.mark_computed(seq, e)


def append(bm, kv, seq, tok):
    seq.append(tok)
    slot, cp = bm.append_slot(seq)
    if cp is not None:
        assert bm.ref[cp[1]] == 1 and cp[0] != cp[1]
        kv.copy(*cp)
    assert bm.ref[slot // bm.block_size] == 1, "write into a shared block"
    kv.write(np.array([slot]), [tok], [len(seq.token_ids) - 1])


# ------------------------------------------------------------------------- unit tests
def test_prefix_hit_and_fork_cow():
    bm, kv = BlockManager(16, 4, watermark=0), FakeKV(16, 4)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    assert a.num_computed_tokens == 0 and len(a.block_table) == 3
    compute(bm, kv, a)
    b = Sequence(list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert kv.read_ok(bm, b, 8)
    compute(bm, kv, b)
    fam = bm.fork(a, 3)
    assert all(s.block_table == a.block_table for s in fam)
    assert bm.ref[a.block_table[2]] == 3 and bm.ref[a.block_table[0]] == 4
    need = bm.blocks_to_append(fam)
    free0 = bm.num_free_blocks
    for i, s in enumerate(fam):
        append(bm, kv, s, 50 + i)
    assert free0 - bm.num_free_blocks == need == 2  # two copies, last one writes in place
    for s in fam:
        assert kv.read_ok(bm, s, len(s.token_ids))
    st_ = bm.stats()
    assert st_["blocks_saved"] == st_["holdings"] - st_["used_blocks"] > 0
    for s in fam + [b]:
        bm.free(s)
    assert bm.num_free_blocks == 16 and bm.num_held == 0


def test_forked_samples_share_the_prompt_list_and_keep_their_own_tokens():
    """fork copies no prompt (samples share one list, never written) and each sample's tokens stay
    its own; ``tokens`` reads across the two parts; a sampled token is never written into the prompt."""
    bm = BlockManager(NB, BS)
    seq = Sequence([1, 2, 3, 4, 5, 6])
    bm.allocate(seq)
    bm.mark_computed(seq, 6)
    fam = bm.fork(seq, 3)
    assert all(s.prompt is seq.prompt for s in fam) and len({id(s.out) for s in fam}) == 3
    for k, s in enumerate(fam):
        s.append(10 + k)
        s.append(20 + k)
        s.set_token(7, 30 + k)
    assert [s.token_ids for s in fam] == [[1, 2, 3, 4, 5, 6, 10 + k, 30 + k] for k in range(3)]
    assert [s.output_token_ids for s in fam] == [[10 + k, 30 + k] for k in range(3)]
    assert fam[1].tokens(4, 8) == [5, 6, 11, 31] and fam[1].tokens(1, 3) == [2, 3] and fam[1].tokens(6, 7) == [11]
    assert fam[2].last_token == 32 and len(fam[2]) == 8 and fam[2].num_output_tokens == 2
    with pytest.raises(ValueError, match="prompt"):
        fam[0].set_token(5, 0)
    assert seq.prompt == [1, 2, 3, 4, 5, 6]


def test_full_prompt_hit_leaves_one_token():
    bm = BlockManager(8, 4, watermark=0)
    kv = FakeKV(8, 4)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    compute(bm, kv, a)
    b = Sequence(list(range(8)))
    bm.allocate(b)  # both blocks cached, but the last token must be computed: one block reused
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]


def test_collision_never_shares_wrong_kv():
    bm, kv = BlockManager(16, 2, watermark=0, hash_fn=lambda key: 0), FakeKV(16, 2)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, kv, a)
    b = Sequence([3, 4, 5])  # its first block hashes like a's first block but differs
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    c = Sequence([1, 2, 9])  # same content as a's first block: a real hit
    bm.allocate(c)
    assert c.num_computed_tokens == 2 and c.block_table[0] == a.block_table[0]


def test_reset_prefix_cache_forgets_contents_only_when_no_block_is_held():
    bm, kv = BlockManager(16, 4, watermark=0), FakeKV(16, 4)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    compute(bm, kv, a)
    assert not bm.reset_prefix_cache()  # (a holds its blocks)
    bm.free(a)
    assert bm.stats()["cached_blocks"] == 2 and bm.reset_prefix_cache()
    assert bm.stats()["cached_blocks"] == 0 and bm.num_free_blocks == 16
    b = Sequence(list(range(10)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0  # nothing matched: its KV is computed again
    compute(bm, kv, b)
    bm.free(b)
    c = Sequence(list(range(10)))
    bm.allocate(c)
    assert c.num_computed_tokens == 8 and kv.read_ok(bm, c, 8)  # the new contents are cached again


def test_chain_key_includes_prefix():
    bm, kv = BlockManager(16, 2, watermark=0), FakeKV(16, 2)
    a = Sequence([1, 2, 3, 4, 0])
    bm.allocate(a)
    compute(bm, kv, a)
    b = Sequence([9, 9, 3, 4, 0])  # same second block tokens, different prefix
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_freed_cached_block_reused_then_evicted():
    bm, kv = BlockManager(4, 2, watermark=0), FakeKV(4, 2)
    a = Sequence([1, 2, 3])
    bm.allocate(a)
    compute(bm, kv, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = Sequence([1, 2, 7])
    bm.allocate(b)
    assert b.num_computed_tokens == 2 and kv.read_ok(bm, b, 2)
    bm.free(b)
    c = Sequence([5, 6, 7, 8, 9, 10, 11, 12])  # takes every block, evicting the cache
    bm.allocate(c)
    compute(bm, kv, c)
    bm.free(c)
    d = Sequence([1, 2, 7])
    bm.allocate(d)
    assert d.num_computed_tokens == 0


def test_can_allocate_watermark():
    bm = BlockManager(10, 4, watermark=0.2)
    assert bm.can_allocate(Sequence(list(range(32))))       # 8 blocks, 2 left
    assert not bm.can_allocate(Sequence(list(range(33))))   # 9 blocks, 1 left < 2


# ------------------------------------------------------------------------- state machine
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)
prefixes = [[0, 1, 2, 0], [0, 1, 2, 0, 1, 1, 2, 2], [2, 2, 1, 0, 0, 1]]


class BlockManagerMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(hash)

    @initialize()
    def setup(self):
        self.bm = BlockManager(NB, BS, watermark=0, hash_fn=self.hash_fn)
        self.kv = FakeKV(NB, BS)
        self.live: list[Sequence] = []
        self.family: dict[int, tuple[int, list[Sequence]]] = {}  # id -> (shared blocks, members)

    def _add(self, seqs):
        if not self.bm.can_allocate(seqs):
            return False
        free0, need = self.bm.num_free_blocks, self.bm.blocks_to_allocate(seqs)
        self.bm.allocate(seqs)
        assert free0 - self.bm.num_free_blocks == need
        for s in seqs:  # the leader first: a sibling's shared blocks hold KV once it ran
            assert self.kv.read_ok(self.bm, s, s.num_computed_tokens)  # prefix-cache hits
            compute(self.bm, self.kv, s, self.live + seqs)
            s.wait_for = None
        self.live += seqs
        return True

    @rule(p=st.sampled_from(range(len(prefixes) + 1)), suffix=tokens)
    def add(self, p, suffix):
        STEPS["n"] += 1
        self._add([Sequence((prefixes[p] if p < len(prefixes) else []) + suffix)])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10 ** 6), n=st.integers(1, 4))
    def fork(self, i, n):
        STEPS["n"] += 1
        seq = self.live[i % len(self.live)]
        for s in self.family.values():
            if seq in s[1]:
                return  # keep families simple: fork only roots
        fam = self.bm.fork(seq, n)
        assert all(s.block_table == seq.block_table for s in fam)
        for s in fam[1:]:
            s.num_prompt_tokens = len(seq.token_ids)
        seq.num_prompt_tokens = len(seq.token_ids)
        self.live += fam[1:]
        self.family[seq.seq_id] = (len(seq.token_ids) // BS, fam)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10 ** 6), tok=st.integers(0, 2))
    def append_one(self, i, tok):
        STEPS["n"] += 1
        s = self.live[i % len(self.live)]
        if len(s.token_ids) < 40 and self.bm.can_append(s):
            append(self.bm, self.kv, s, tok)

    @precondition(lambda self: self.family)
    @rule(i=st.integers(0, 10 ** 6), toks=st.lists(st.integers(0, 2), min_size=4, max_size=4))
    def append_family(self, i, toks):
        STEPS["n"] += 1
        fam = list(self.family.values())[i % len(self.family)][1]
        fam = [s for s in fam if s in self.live and len(s.token_ids) < 40]
        need = self.bm.blocks_to_append(fam)
        if need > self.bm.num_free_blocks:
            return
        free0 = self.bm.num_free_blocks
        for j, s in enumerate(fam):
            append(self.bm, self.kv, s, toks[j % 4])
        assert free0 - self.bm.num_free_blocks == need  # exact need

    def _drop(self, s):
        self.bm.free(s)
        self.live.remove(s)
        for k, (nb, members) in list(self.family.items()):
            if s in members:
                members.remove(s)
                if not members:
                    del self.family[k]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10 ** 6))
    def free(self, i):
        STEPS["n"] += 1
        self._drop(self.live[i % len(self.live)])

    @precondition(lambda self: self.family)
    @rule(i=st.integers(0, 10 ** 6))
    def preempt_family(self, i):
        """Recompute preemption of a whole family: free, then re-allocate together (leader via
        the prefix cache, siblings sharing the leader's prompt blocks)."""
        STEPS["n"] += 1
        key = list(self.family)[i % len(self.family)]
        nb, fam = self.family[key]
        fam = list(fam)
        for s in fam:
            self._drop(s)
        if self._add(fam):
            nb = min([nb] + [(len(s.token_ids) - 1) // BS for s in fam[1:]])
            for s in fam[1:]:
                assert s.block_table[:nb] == fam[0].block_table[:nb]
            self.family[fam[0].seq_id] = (nb, fam)

    # --------------------------------------------------------------------- invariants
    @invariant()
    def ref_counts_match_holders(self):
        if not hasattr(self, "bm"):
            return
        bm, count = self.bm, [0] * NB
        for s in self.live:
            assert len(set(s.block_table)) == len(s.block_table)
            for b in s.block_table:
                count[b] += 1
        assert count == bm.ref.tolist()
        assert sum(count) == bm.num_held
        free = set(bm.free_ids)
        assert free == {b for b in range(NB) if count[b] == 0}  # never both free and held
        assert len(free) + sum(c > 0 for c in count) == NB

    @invariant()
    def tables_and_kv(self):
        if not hasattr(self, "bm"):
            return
        bm, rows = self.bm, set()
        for s in self.live:
            assert s.row not in rows
            rows.add(s.row)
            n = len(s.block_table)
            assert bm.table[s.row, :n].tolist() == s.block_table
            assert not bm.table[s.row, n:].any()
            assert s.num_computed_tokens == len(s.token_ids)
            assert self.kv.read_ok(bm, s, len(s.token_ids))
        for nb, fam in self.family.values():  # forked samples read identical prefix blocks
            live = [s for s in fam if s in self.live]
            for s in live[1:]:
                assert s.block_table[:nb] == live[0].block_table[:nb]
        for h, b in bm.hash_to_block.items():  # every cached block holds the KV its key names
            assert bm.block_hash[b] == h
            parent, toks = bm.block_key[b]
            assert self.kv.tok[b * BS:(b + 1) * BS].tolist() == list(toks)

    def teardown(self):
        if hasattr(self, "bm"):
            for s in list(self.live):
                self._drop(s)
            assert self.bm.num_free_blocks == NB and self.bm.num_held == 0


class CollidingHashMachine(BlockManagerMachine):
    hash_fn = staticmethod(lambda key: hash(key) % 5)


MACHINE_SETTINGS = dict(max_examples=140, stateful_step_count=50, deadline=None,
                        derandomize=True, database=None,
                        suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("machine", [BlockManagerMachine, CollidingHashMachine])
def test_block_manager_state_machine(machine):
    before = STEPS["n"]
    run_state_machine_as_test(machine, settings=settings(**MACHINE_SETTINGS))
    print(f"{machine.__name__}: {STEPS['n'] - before} rule steps")
    assert STEPS["n"] - before >= 5000
