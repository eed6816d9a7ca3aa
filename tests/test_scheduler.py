"""Scheduler: a fake engine checks every batch against a fake KV cache; a hypothesis state
machine over add/step/preempt; liveness under memory pressure; import without torch/triton."""
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from paged_backend.scheduler import BlockManager, SamplingParams, Scheduler, SequenceStatus

STEPS = {"n": 0}


class FakeEngine:
    """Runs a ScheduledBatch against a fake KV cache holding (token, position) per slot and
    checks the batch contract; samples tokens with a seeded rng."""

    def __init__(self, sched: Scheduler, seed=0, vocab=3):
        bm = sched.bm
        self.sched, self.bs = sched, bm.block_size
        self.tok = np.full(bm.num_blocks * bm.block_size, -1, np.int64)
        self.pos = np.full_like(self.tok, -1)
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def step(self):
        sched, bs = self.sched, self.bs
        b = sched.schedule()
        B, T = len(b.seqs), b.num_tokens
        assert B > 0 or not sched.has_unfinished(), "an idle step with requests pending"
        assert b.seq_ids.shape == (B,) and b.seq_lens.shape == (B,)
        assert b.block_tables.dtype == np.int32 and b.seq_lens.dtype == np.int32
        assert b.query_start_loc.dtype == np.int32 and b.query_start_loc.shape == (B + 1,)
        assert b.slot_mapping.dtype == np.int64 and b.slot_mapping.shape == (T,)
        assert b.block_copies.dtype == np.int64 and b.block_copies.shape[1] == 2
        assert len(set(b.seq_ids.tolist())) == B, "a sequence scheduled twice"
        assert len(set(b.slot_mapping.tolist())) == T, "two tokens write one slot"
        assert T <= sched.max_num_batched_tokens and B <= sched.max_num_seqs
        qlen = np.diff(b.query_start_loc)
        assert (qlen[:b.num_decodes] == 1).all() and (qlen >= 1).all()
        assert b.num_prefill_tokens == T - b.num_decodes
        dsts = b.block_copies[:, 1].tolist()
        assert len(set(dsts)) == len(dsts) and not set(dsts) & set(b.block_copies[:, 0].tolist())
        for src, dst in b.block_copies.tolist():  # copies run before the writes
            assert sched.bm.ref[src] >= 1 and sched.bm.ref[dst] >= 1
            self.tok[dst * bs:(dst + 1) * bs] = self.tok[src * bs:(src + 1) * bs]
            self.pos[dst * bs:(dst + 1) * bs] = self.pos[src * bs:(src + 1) * bs]
        live = [s for g in sched.running for s in g.seqs if s.status is SequenceStatus.RUNNING]
        for i, s in enumerate(b.seqs):
            a, e = int(b.query_start_loc[i]), int(b.query_start_loc[i + 1])
            L = int(b.seq_lens[i])
            p = np.arange(L - (e - a), L)
            assert np.array_equal(b.positions[a:e], p)
            assert b.input_ids[a:e].tolist() == s.token_ids[L - (e - a):L]
            nblk = -(-L // bs)
            assert b.block_tables[i, :nblk].tolist() == s.block_table[:nblk]
            assert not b.block_tables[i, nblk:].any()
            want = np.asarray(s.block_table, np.int64)[p // bs] * bs + p % bs
            assert np.array_equal(b.slot_mapping[a:e], want)
            for blk in set((want // bs).tolist()):  # nobody else may write these blocks
                for h in live:
                    if h is not s and blk in h.block_table:
                        assert (h.block_table.index(blk) + 1) * bs <= h.num_computed_tokens
            finishing = L == len(s.token_ids)
            n = 1 if s.group.forked else s.group.params.n
            assert b.num_samples[i] == (n if finishing else 0)
        self.tok[b.slot_mapping] = b.input_ids
        self.pos[b.slot_mapping] = b.positions
        for i, s in enumerate(b.seqs):  # attention reads exactly this sequence's tokens
            L = int(b.seq_lens[i])
            p = np.arange(L)
            slots = b.block_tables[i, p // bs].astype(np.int64) * bs + p % bs
            assert self.tok[slots].tolist() == s.token_ids[:L]
            assert np.array_equal(self.pos[slots], p)
        grouped = [i for g in b.share_groups for i in g]
        assert len(set(grouped)) == len(grouped)
        firsts = b.block_tables[:, 0].tolist() if B else []
        for g, n in zip(b.share_groups, b.share_blocks):  # exact: n shared, column n is not
            assert len(g) >= 2 and n >= 1 and g == sorted(g)
            assert len({firsts[i] for i in g}) == 1
            assert sum(firsts[i] == firsts[g[0]] for i in range(B)) == len(g)
            for i in g:
                assert b.block_tables[i, :n].tolist() == b.block_tables[g[0], :n].tolist()
            lim = min(-(-int(b.seq_lens[i]) // bs) for i in g)
            assert n == lim or len({int(b.block_tables[i, n]) for i in g}) > 1
        sampled = self.rng.integers(0, self.vocab, int(b.num_samples.sum()))
        return b, sched.postprocess(b, sampled)


def check_accounting(sched: Scheduler):
    """Every request is in exactly one place; running seq count and ref counts are exact."""
    w = [g.request_id for g in sched.waiting]
    r = [g.request_id for g in sched.running]
    assert len(set(w)) == len(w) and len(set(r)) == len(r) and not set(w) & set(r)
    for rid, g in sched.requests.items():
        assert (rid in w) + (rid in r) + g.is_finished == 1, rid
        assert g.num_live == sum(not s.is_finished for s in g.seqs)
    assert sched._num_running_seqs == sum(g.num_seq_slots for g in sched.running)
    ref = [0] * sched.bm.num_blocks
    for g in sched.running:
        for s in g.seqs:
            if s.status is SequenceStatus.RUNNING:
                for blk in s.block_table:
                    ref[blk] += 1
            else:
                assert not s.block_table
    for g in sched.waiting:
        assert all(not s.block_table for s in g.seqs)
    assert ref == sched.bm.ref.tolist()
    assert set(sched.bm.free_ids) == {i for i, c in enumerate(ref) if c == 0}


def check_finished(sched: Scheduler):
    for g in sched.requests.values():
        assert g.is_finished and len(g.seqs) == g.params.n
        assert len({s.seq_id for s in g.seqs}) == g.params.n
        for s in g.seqs:
            out = s.output_token_ids
            assert 1 <= len(out) <= g.params.max_tokens
            if len(out) < g.params.max_tokens:
                assert s.finish_reason == "stop" and out[-1] in g.params.stop_token_ids
            assert not any(t in g.params.stop_token_ids for t in out[:-1])
    assert sched.bm.num_free_blocks == sched.bm.num_blocks and sched.bm.num_held == 0


def drain(sched, eng, max_steps=5000):
    steps = 0
    while sched.has_unfinished():
        eng.step()
        check_accounting(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


# ------------------------------------------------------------------------- unit tests
def test_fork_after_prompt_and_cow_copies():
    sched = Scheduler(BlockManager(64, 4, watermark=0), max_num_seqs=8, max_num_batched_tokens=64)
    eng = FakeEngine(sched)
    g = sched.add_request(list(range(10)), SamplingParams(n=3, max_tokens=5))
    b, _ = eng.step()
    assert b.num_samples.tolist() == [3] and b.num_prefill_tokens == 10
    assert len(g.seqs) == 3 and g.forked
    b, _ = eng.step()  # 10 % 4 = 2: the partial last block is shared, copied by 2 of 3
    assert b.num_decodes == 3 and b.block_copies.shape == (2, 2)
    assert b.share_groups == [[0, 1, 2]] and b.share_blocks == [2]
    drain(sched, eng)
    check_finished(sched)


def test_chunked_prefill_and_prefix_cache():
    sched = Scheduler(BlockManager(64, 4, watermark=0), max_num_seqs=4, max_num_batched_tokens=8)
    eng = FakeEngine(sched)
    sched.add_request(list(range(20)), SamplingParams(max_tokens=2))
    b, _ = eng.step()
    assert b.num_prefill_tokens == 8 and b.num_samples.tolist() == [0]
    drain(sched, eng)
    g2 = sched.add_request(list(range(16)) + [7, 7], SamplingParams(max_tokens=2))
    b, _ = eng.step()  # 4 cached blocks reused: only 2 new tokens
    assert b.num_prefill_tokens == 2 and b.seq_lens.tolist() == [18]
    drain(sched, eng)
    assert sched.bm.stats()["prefix_hit_rate"] > 0
    assert g2.is_finished


def test_preempt_resume_reuses_cached_blocks():
    sched = Scheduler(BlockManager(64, 4, watermark=0), max_num_seqs=8, max_num_batched_tokens=64)
    eng = FakeEngine(sched)
    g = sched.add_request(list(range(9)), SamplingParams(n=2, max_tokens=12))
    for _ in range(8):
        eng.step()
    assert all(len(s.token_ids) == 17 for s in g.seqs)
    sched.preempt(g)
    assert sched.waiting[0] is g and not sched.running
    b, _ = eng.step()  # leader: 16 of 17 tokens cached (prompt + decoded blocks)
    assert b.num_prefill_tokens == 2 and g.num_preemptions == 1  # each sample: 16 of 17 cached
    drain(sched, eng)
    check_finished(sched)


def test_stop_token_and_stop_string():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=16,
                      detokenize=lambda ids: "".join("ab"[t % 2] for t in ids))
    g1 = sched.add_request([1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[5]))
    g2 = sched.add_request([1, 2], SamplingParams(max_tokens=10, stop=["ba"]))
    b = sched.schedule()
    sched.postprocess(b, [5, 1])
    assert g1.is_finished and g1.finish_reasons == ["stop"] and g1.outputs == [[5]]
    b = sched.schedule()
    assert b.seq_ids.tolist() == [g2.seqs[0].seq_id]
    sched.postprocess(b, [0])
    assert g2.is_finished and g2.outputs == [[1, 0]]
    assert sched.bm.num_free_blocks == 32


def test_stop_string_found_from_the_tail_only():
    """The stop check decodes a tail of 4 tokens per stop-string character (+4), never the whole output."""
    seen = []

    def detok(ids):
        seen.append(len(ids))
        return "".join("ab"[t % 2] for t in ids)

    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=16, detokenize=detok)
    g = sched.add_request([1, 2], SamplingParams(max_tokens=40, stop=["bba"]))
    toks = [0] * 30 + [1, 1, 0]
    for t in toks:
        sched.postprocess(sched.schedule(), [t])
    assert g.is_finished and g.finish_reasons == ["stop"] and len(g.outputs[0]) == 33
    assert max(seen) == 4 * 3 + 4


def test_abort_frees_blocks_wherever_the_request_is():
    sched = Scheduler(BlockManager(64, 4, watermark=0), max_num_seqs=8, max_num_batched_tokens=64)
    eng = FakeEngine(sched)
    running = sched.add_request(list(range(10)), SamplingParams(n=3, max_tokens=20))
    other = sched.add_request(list(range(5)), SamplingParams(n=2, max_tokens=6))
    eng.step()
    eng.step()
    waiting = sched.add_request(list(range(7)), SamplingParams(max_tokens=4))
    for rid in (running.request_id, waiting.request_id):
        g = sched.abort(rid)
        assert g.is_finished and all(s.finish_reason == "abort" for s in g.seqs)
        assert rid not in sched.requests
        check_accounting(sched)
    with pytest.raises(ValueError, match="request_id"):
        sched.abort(running.request_id)
    drain(sched, eng)
    assert other.is_finished and sched.bm.num_free_blocks == sched.bm.num_blocks


def test_request_validation():
    sched = Scheduler(BlockManager(10, 4, watermark=0.1), max_num_seqs=4, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(list(range(30)), SamplingParams(max_tokens=10))  # 10 blocks > 9
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request([1], SamplingParams(n=5))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request([])
    sched.add_request([1], request_id="a")
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request([1], request_id="a")
    with pytest.raises(ValueError):
        Scheduler(BlockManager(10, 4), max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="expected 1 sampled"):
        sched.postprocess(sched.schedule(), [1, 2])


@pytest.mark.parametrize("seed", range(6))
def test_liveness_under_memory_pressure(seed):
    rng = np.random.default_rng(seed)
    nb, bs = int(rng.integers(12, 40)), int(rng.choice([1, 2, 4, 8]))
    sched = Scheduler(BlockManager(nb, bs, watermark=0.05), max_num_seqs=int(rng.integers(3, 12)),
                      max_num_batched_tokens=int(rng.integers(12, 40)))
    eng = FakeEngine(sched, seed, vocab=4)
    prefixes = [rng.integers(0, 4, int(rng.integers(1, 20))).tolist() for _ in range(3)]
    added = 0
    for i in range(60):
        p = SamplingParams(n=int(rng.integers(1, 4)), max_tokens=int(rng.integers(1, 20)),
                           stop_token_ids=[3] if rng.random() < 0.3 else [])
        prompt = prefixes[i % 3] + rng.integers(0, 4, int(rng.integers(0, 10))).tolist()
        try:
            sched.add_request(prompt, p)
            added += 1
        except ValueError:
            assert sched.max_blocks_needed(len(prompt), p) > nb - sched.bm.watermark_blocks
        if rng.random() < 0.5:
            eng.step()
            check_accounting(sched)
    drain(sched, eng)
    check_finished(sched)
    assert added >= 20 and len(sched.requests) == added
    assert sched.num_preemptions > 0 or seed  # the first config is tight enough to preempt


# ------------------------------------------------------------------------- state machine
class SchedulerMachine(RuleBasedStateMachine):
    @initialize(nb=st.integers(10, 40), bs=st.sampled_from([1, 2, 4, 8]),
                max_seqs=st.integers(1, 8), extra_tokens=st.integers(0, 24), seed=st.integers(0, 99))
    def setup(self, nb, bs, max_seqs, extra_tokens, seed):
        self.sched = Scheduler(BlockManager(nb, bs, watermark=0.05), max_num_seqs=max_seqs,
                               max_num_batched_tokens=max_seqs + extra_tokens)
        self.eng = FakeEngine(self.sched, seed)

    @rule(prefix=st.sampled_from([[], [0, 1, 2, 0, 1, 2, 2, 1], [2, 2, 2, 1, 0]]),
          suffix=st.lists(st.integers(0, 2), max_size=8), n=st.integers(1, 3),
          max_tokens=st.integers(1, 12), stop=st.booleans())
    def add(self, prefix, suffix, n, max_tokens, stop):
        STEPS["n"] += 1
        prompt = prefix + suffix or [1]
        p = SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=[2] if stop else [])
        try:
            self.sched.add_request(prompt, p)
        except ValueError:
            s = self.sched
            assert n > s.max_num_seqs or s.max_blocks_needed(len(prompt), p) > \
                s.bm.num_blocks - s.bm.watermark_blocks

    @rule()
    def step(self):
        STEPS["n"] += 1
        self.eng.step()

    @precondition(lambda self: hasattr(self, "sched") and self.sched.running)
    @rule(i=st.integers(0, 100))
    def preempt(self, i):
        STEPS["n"] += 1
        self.sched.preempt(self.sched.running[i % len(self.sched.running)])

    @invariant()
    def accounting(self):
        if hasattr(self, "sched"):
            check_accounting(self.sched)

    def teardown(self):
        if hasattr(self, "sched"):
            drain(self.sched, self.eng)
            check_finished(self.sched)


def test_scheduler_state_machine():
    before = STEPS["n"]
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=100, stateful_step_count=60, deadline=None, derandomize=True,
        database=None, suppress_health_check=list(HealthCheck)))
    print(f"SchedulerMachine: {STEPS['n'] - before} rule steps")
    assert STEPS["n"] - before >= 4000


def test_import_without_torch_or_triton(tmp_path):
    code = ("import sys\n"
            "for m in ('torch', 'triton'): sys.modules[m] = None\n"
            "import paged_backend.scheduler\n"
            "from paged_backend.scheduler import BlockManager, Scheduler, SamplingParams\n"
            "s = Scheduler(BlockManager(8, 4)); s.add_request([1, 2]); s.schedule()\n"
            "assert not any(m.split('.')[0] in ('torch', 'triton') and sys.modules[m] is not None"
            " for m in sys.modules)\n")
    # outside the repository: the installed paged_backend.scheduler, not the source folder
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------- steps run ahead
def _draw(batch, vocab=29):
    """Tokens as a function of (request, sample index, position) only: the same in any step order."""
    out = []
    for s, c in zip(batch.seqs, batch.num_samples.tolist()):
        pos = int(batch.seq_lens[batch.seqs.index(s)])
        rid = int(s.group.request_id)
        out += [(rid * 7 + j * 13 + pos * 31) % vocab for j in range(c)] if c > 1 else \
            [(rid * 7 + s.group.seqs.index(s) * 13 + pos * 31) % vocab] * c
    return out


def _workload(sched):
    for i, (prompt, n, most) in enumerate([(5, 1, 9), (11, 3, 14), (3, 2, 6), (20, 1, 25), (7, 4, 11)]):
        sched.add_request(list(range(1, prompt + 1)), SamplingParams(n=n, max_tokens=most, stop_token_ids=[6]),
                          request_id=str(i))


def test_steps_run_ahead_give_the_same_outputs():
    """An engine that schedules step t + 1 before step t's tokens are back (run_ahead, the ids of
    its PENDING places read from step t's tokens, of the rows that go on) ends every request as the
    synchronous loop does, with the same KV contents checked per step and every block freed; steps
    run ahead past samples ending by length too."""
    def make():
        sched = Scheduler(BlockManager(64, 4), max_num_seqs=16, max_num_batched_tokens=32)
        _workload(sched)
        return sched

    sync = make()
    while sync.has_unfinished():
        b = sync.schedule()
        sync.postprocess(b, _draw(b))
    want = {rid: (g.outputs, g.finish_reasons) for rid, g in sync.requests.items()}

    sched, ahead, steps, stale, fewer = make(), 0, 0, 0, 0
    eng = FakeEngine(sched)
    pending = None  # (batch, its tokens)
    while pending is not None or sched.has_unfinished():
        if pending is None:
            b = sched.schedule()
            pending = (b, _draw(b))
        nxt = None
        if sched.can_run_ahead(pending[0]):
            going = [i for i, s in enumerate(pending[0].seqs)  # (the samples not ending by length)
                     if len(s.token_ids) + 1 - s.num_prompt_tokens < s.group.params.max_tokens]
            sched.run_ahead(pending[0])
            b = sched.schedule()
            was = pending[0].seq_ids.tolist()
            assert b.seq_ids.tolist() == [was[i] for i in going] and not b.num_prefill_tokens
            fewer += len(going) < len(was)
            assert (b.input_ids == -1).all()  # every input id is in flight: the engine reads them on the device
            b.input_ids[:] = np.asarray(pending[1])[going]
            eng.tok[b.slot_mapping] = b.input_ids
            nxt = (b, None)
            ahead += 1
        stale += sum(s.status is SequenceStatus.FINISHED for s in pending[0].seqs)  # ended one step before
        sched.postprocess(*pending)
        check_accounting(sched)
        if nxt is not None:
            for i, s in enumerate(nxt[0].seqs):  # the row's input is the token now in its place
                assert s.token_ids[int(nxt[0].seq_lens[i]) - 1] == nxt[0].input_ids[i]
            nxt = (nxt[0], _draw(nxt[0]))
        pending = nxt
        steps += 1
        assert steps < 500
    assert ahead >= steps // 3 and stale and fewer, (ahead, steps, stale, fewer)  # (stale: a row run past its stop token was dropped)
    assert {rid: (g.outputs, g.finish_reasons) for rid, g in sched.requests.items()} == want
    assert sched.bm.num_free_blocks == sched.bm.num_blocks and sched.bm.num_held == 0


def test_can_run_ahead_only_in_steady_decode():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=32)
    sched.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=3), request_id="a")
    b = sched.schedule()
    assert not sched.can_run_ahead(b)  # a prefill step (it forks)
    sched.postprocess(b, [1, 1])
    b = sched.schedule()
    assert sched.can_run_ahead(b)  # two samples decoding, one token each
    sched.add_request([4, 5], SamplingParams(max_tokens=3), request_id="b")
    assert not sched.can_run_ahead(b)  # a request waits: the next step admits it
    sched.abort("b")
    sched.postprocess(b, [2, 2])
    b = sched.schedule()
    assert not sched.can_run_ahead(b)  # both samples end by length with this step (3 tokens): none goes on
    sched.postprocess(b, [3, 3])
    sched.add_request([6], SamplingParams(max_tokens=2), request_id="c")
    sched.add_request([7], SamplingParams(max_tokens=5), request_id="d")
    b = sched.schedule()
    sched.postprocess(b, [1, 1])
    b = sched.schedule()
    assert sched.can_run_ahead(b)  # "c" ends by length with this step, "d" goes on
    sched.run_ahead(b)
    nxt = sched.schedule()
    assert [s.group.request_id for s in nxt.seqs] == ["d"]  # the next step leaves "c" out
    assert sched.postprocess(b, [4, 4])[0].request_id == "c"


def test_share_groups_by_first_block():
    """A step's rows grouped by their first block id (groups of two or more rows, each ascending, in
    order of that id): against a plain dictionary grouping, for one prompt's samples (one group),
    rows that share nothing, and mixes with singletons."""
    rng = np.random.default_rng(0)
    for firsts in ([7] * 5, [3, 1, 2], [4, 9, 4, 1, 9, 9, 2], list(rng.integers(0, 6, 40)), [5]):
        bt = np.zeros((len(firsts), 3), np.int32)
        bt[:, 0] = firsts
        want = {}
        for i, f in enumerate(firsts):
            want.setdefault(f, []).append(i)
        assert Scheduler._share_groups(bt) == [want[f] for f in sorted(want) if len(want[f]) >= 2], firsts
