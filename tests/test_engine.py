"""The engine with the embedded SmolLM2-135M-Instruct (fp32, CPU): greedy tokens equal
transformers' generate(); batch invariance; seeded sampling; preemption under KV exhaustion;
stop strings, logprobs; bad input refused with the input named and nothing finished lost."""
import copy
import gc
import operator

import numpy as np
import pytest
import torch

from paged_backend.integration import LLM, SamplingParams, models

pytestmark = pytest.mark.xdist_group("engine")

PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "def fibonacci(n):",
           "List three colors:\n1."]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def llm():
    if models.default_model_path() is None:  # the README's install puts it there: missing is a failure
        pytest.fail(f"the embedded model is not installed: {models.DEFAULT_MODEL_HINT}", pytrace=False)
    return LLM(device="cpu", num_blocks=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy output, run on its own."""
    return {p: llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}


def test_greedy_batch_equals_transformers_generate(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ref = copy.deepcopy(llm.model)
    ref.set_attn_implementation("sdpa")
    eos = set(llm.info.eos_token_ids)
    for p, o in zip(PROMPTS, outs):
        ids = torch.tensor([llm.tokenizer(p).input_ids])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        want = want[0, ids.shape[1]:].tolist()
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))  # generate pads after EOS
        assert o.outputs[0].token_ids == want[:cut], p
        assert o.outputs[0].token_ids == alone[p], "batch invariance: output changed with the batch"
    assert outs[0].outputs[0].text.startswith(" Paris")


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    c = out.outputs[0]
    assert "Paris" in c.text and c.finish_reason == "stop" and c.token_ids[-1] in llm.info.eos_token_ids


def test_top_k_1_samples_are_greedy(llm, alone):
    """top_k=1 leaves one token to draw whatever the noise: seed 376 drew another token before the
    noise was made finite (its key hit the last of 2^24 buckets: u = 1, noise +inf)."""
    want = alone[PROMPTS[0]][:3]
    for seed in (376, 0, 1, 2 ** 63, 2 ** 64 - 1):
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_k=1, seed=seed, max_tokens=3),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want, seed


def test_prefix_cache_hit_and_forked_greedy_samples(llm, alone):
    long = PROMPTS[1]  # 2 full blocks of 16: cached since the fixture ran it
    before = llm.sched.bm.prefix_hit_tokens
    outs = llm.generate([long], SamplingParams(n=3, temperature=0, max_tokens=32), use_tqdm=False)
    assert llm.sched.bm.prefix_hit_tokens - before >= 16
    assert [c.token_ids for c in outs[0].outputs] == [alone[long]] * 3
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]


def test_seeded_sampling_is_reproducible_and_samples_differ(llm):
    p = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    a = llm.generate(PROMPTS[0], p, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3]], [p] * 3, use_tqdm=False)[1]  # other batch mates
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4
    c = llm.generate(PROMPTS[0], SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=16, seed=99,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [x.token_ids for x in c.outputs] != [x.token_ids for x in a.outputs]


def test_kv_exhaustion_preempts_and_resumes_with_the_same_output(llm):
    """A pool of 10 blocks cannot hold 4 x (prompt + 32 tokens) (13 blocks): requests are preempted
    and recomputed, and every greedy output is the large pool's. One request can never fit: it
    comes back with the limit named, and the others still run."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    small = LLM(device="cpu", num_blocks=10, max_num_seqs=8)
    too_big = SamplingParams(n=8, temperature=0, max_tokens=60)
    outs = small.generate(PROMPTS + [PROMPTS[0]], [params] * 4 + [too_big], use_tqdm=False)
    assert small.last_stats.preemptions > 0
    for w, o in zip(want, outs):
        assert o.error is None and o.outputs[0].token_ids == w
    assert outs[4].outputs == [] and "KV blocks" in outs[4].error and "num_blocks=10" in outs[4].error
    assert small.last_stats.num_rejected == 1
    assert small.sched.bm.num_free_blocks == small.cache.num_blocks  # everything freed


def test_cumulative_logprob_is_the_tokens_sum_in_order(llm):
    """A sample's cumulative log-probability - summed a step at a time in one array while a step's
    samples are the last one's (``SampleBook.record``) - is its tokens' log-probabilities added one
    by one in order, bit for bit: the per-token sums of the same draws (``logprobs=0``, which keeps
    every step on the one-by-one path), across a fork and samples ending at different steps."""
    def params(**kw):
        return [SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=m, ignore_eos=True, **kw) for m in (20, 11)]
    plain = llm.generate(PROMPTS[:2], params(), use_tqdm=False)
    each = llm.generate(PROMPTS[:2], params(logprobs=0), use_tqdm=False)
    for o, e in zip(plain, each):
        for c, d in zip(o.outputs, e.outputs):
            total = 0.0
            for t, entry in zip(d.token_ids, d.logprobs):
                total += entry[t]
            assert c.token_ids == d.token_ids and c.cumulative_logprob == d.cumulative_logprob == total


def test_stop_strings_logprobs_and_lengths(llm):
    sp = SamplingParams(temperature=0, max_tokens=32, stop=["\n"], logprobs=3)
    o = llm.generate(PROMPTS[3], sp, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == "\n" and "\n" not in o.text
    assert len(o.logprobs) == len(o.token_ids)
    for t, entry in zip(o.token_ids, o.logprobs):
        assert t in entry and len(entry) in (3, 4) and max(entry.values()) == entry[t]  # greedy: the top one
    assert o.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(o.token_ids, o.logprobs)), abs=1e-4)
    o = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 5


def test_bad_input_is_named_and_nothing_finished_is_lost(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("x", SamplingParams(top_p=0.0))
    with pytest.raises(TypeError, match=r"prompts\[0\]"):
        llm.generate([3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10 ** 7]}, use_tqdm=False)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        LLM("/no/such/model", device="cpu")
    long = {"prompt_token_ids": [42] * (llm.max_model_len + 1)}
    outs = llm.generate([PROMPTS[0], long], GREEDY, use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].token_ids
    assert "max_model_len" in outs[1].error and outs[1].outputs == []


def test_closing_the_iterator_aborts_what_is_left(llm):
    it = llm.generate_iter(PROMPTS, [SamplingParams(temperature=0, max_tokens=m) for m in (1, 40, 40, 40)])
    first = next(it)
    assert len(first.outputs[0].token_ids) == 1
    it.close()
    assert not llm.sched.has_unfinished() and not llm.sched.requests
    bm = llm.sched.bm
    assert bm.num_held == 0 and bm.num_free_blocks == bm.num_blocks
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still usable


def test_the_collector_is_paused_in_the_step_loop_and_the_callers_between_outputs(llm, monkeypatch):
    """No garbage collection on the step loop's path (integration/collector.py); the caller's code
    between two outputs and after the call has the collector as the caller left it."""
    seen = []
    real = llm.sched.__class__.schedule
    monkeypatch.setattr(llm.sched.__class__, "schedule", lambda self: seen.append(gc.isenabled()) or real(self))
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (1, 6, 6, 6)]
    it = llm.generate_iter(PROMPTS, params)
    assert len(next(it).outputs[0].token_ids) == 1 and gc.isenabled()  # (the caller's, between outputs)
    gc.disable()  # switched by the caller between two outputs: kept after the call
    rest = list(it)
    assert len(rest) == 3 and not gc.isenabled()
    gc.enable()
    llm.generate(PROMPTS[:2], params[:2], use_tqdm=False)
    assert gc.isenabled() and seen and not any(seen)
    it = llm.generate_iter(PROMPTS, params)
    next(it)
    it.close()  # closed early (at a yield): restored too
    assert gc.isenabled()


def test_sample_rows_are_batched_per_step(llm, monkeypatch):
    """One sampler call per step, whatever the number of sequences (no per-sequence loop)."""
    calls = []
    real = llm.sampler.__class__.__call__
    monkeypatch.setattr(llm.sampler.__class__, "__call__", lambda self, logits, rows: calls.append(
        logits.shape[0]) or real(self, logits, rows))
    llm.generate(PROMPTS, SamplingParams(n=3, temperature=0.7, max_tokens=4, ignore_eos=True, seed=5), use_tqdm=False)
    assert len(calls) == llm.last_stats.steps and max(calls) == 12
    assert np.sum(calls) == 12 * 4


def test_a_request_with_a_bad_seed_fails_alone(llm):
    """A seed past SamplingParams' checks (set after it was made) fails its own request, before any
    step: the others run and draw the tokens they draw without it, and nothing is left behind."""
    good = [SamplingParams(n=n, temperature=0.8, max_tokens=3, seed=s, ignore_eos=True) for n, s in ((2, 1), (1, 2))]
    want = [[c.token_ids for c in o.outputs] for o in llm.generate([PROMPTS[0], PROMPTS[2]], good, use_tqdm=False)]
    bad = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)
    bad.seed = 2 ** 64  # ignore_eos: the engine makes no copy of it, which would check it again
    outs = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[2]], [good[0], bad, good[1]], use_tqdm=False)
    assert outs[1].outputs == [] and "seed must be an int in [0, 2**64)" in outs[1].error
    assert [[c.token_ids for c in o.outputs] for o in (outs[0], outs[2])] == want
    assert outs[0].error is None and outs[2].error is None and llm.last_stats.num_rejected == 1
    assert not llm.sched.requests and not llm._live and not llm.samples.draws
    assert llm.sched.bm.num_held == 0 and llm.sched.bm.num_free_blocks == llm.sched.bm.num_blocks


def test_a_request_whose_draw_settings_fail_is_aborted_alone(llm, monkeypatch):
    """Any failure of a request's per-request sampling setup ends that request only."""
    from paged_backend.integration import sample_book
    real = sample_book.draw_of
    monkeypatch.setattr(sample_book, "draw_of", lambda r: (_ for _ in ()).throw(TypeError("poisoned"))
                        if r.request_id == "bad" else real(r))
    p = SamplingParams(temperature=0.8, max_tokens=3, seed=7)
    want = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    outs = list(llm.generate_iter([PROMPTS[2], PROMPTS[0]], p, request_ids=["bad", "ok"]))
    assert outs[0].request_id == "bad" and outs[0].error == "poisoned" and outs[0].outputs == []
    assert outs[1].request_id == "ok" and outs[1].error is None and outs[1].outputs[0].token_ids == want
    assert not llm.sched.requests and llm.sched.bm.num_held == 0


def test_uint64_seeds_draw_tokens(llm):
    seeds = [2 ** 64 - 1, 2 ** 63, -1, 0]
    outs = llm.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True)
                                           for s in seeds], use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    assert all(o.error is None for o in outs) and all(len(t) == 3 for t in toks)
    assert toks[2] == toks[0]  # -1 is 2**64 - 1


def test_sampling_params_of_the_wrong_kind_and_messages_without_content_are_named(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.generate("Hi", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\] has no 'content'"):
        llm.chat([{"role": "user"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\]\[1\] has no 'content'"):
        llm.chat([[{"role": "user", "content": "Hi"}],
                  [{"role": "user", "content": "Hi"}, {"role": "assistant"}]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\] has no 'role'"):
        llm.chat([{"content": "Hi"}], use_tqdm=False)


def test_decode_steps_of_the_same_samples_reuse_their_settings(llm, monkeypatch):
    """A decode step of the samples of the last one reuses their sampling settings and noise-key
    parts (SampleBook.rows) and the sampler its device copies of the settings: the outputs equal
    those made with every step's rows and settings built anew; the reuse happened."""
    from paged_backend.integration.sample_book import SampleBook
    from paged_backend.integration.sampler import Sampler
    params = [SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=14, logprobs=2, ignore_eos=True, top_k=20),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, top_p=0.9, min_p=0.05, ignore_eos=True)]
    hits = []
    real = SampleBook.rows
    monkeypatch.setattr(SampleBook, "rows", lambda self, batch: hits.append(self._same is not None and all(
        map(operator.is_, batch.seqs, self._same[0]))) or real(self, batch))
    outs = {}
    for fresh in (False, True):
        if fresh:  # every step's rows built anew, and new arrays for the sampler each time
            monkeypatch.setattr(SampleBook, "rows", lambda self, batch: self._rows(batch))
            monkeypatch.setattr(Sampler, "_settings", None, raising=False)
            monkeypatch.setattr(Sampler, "__setattr__", lambda self, k, v: object.__setattr__(
                self, k, None if k == "_settings" else v))
        got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        outs[fresh] = [(c.token_ids, c.cumulative_logprob, c.logprobs) for o in got for c in o.outputs]
    assert outs[False] == outs[True]
    assert sum(hits) >= 8


def test_steps_run_ahead_change_no_output(llm):
    """With async scheduling (the default) the next decode step is launched before the last one's
    tokens are booked; the outputs - tokens, text, log-probabilities, finish reasons, stop strings,
    EOS - equal the synchronous loop's."""
    params = [SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40),  # runs into EOS
              SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=18, stop=[" the", "."]),
              SamplingParams(temperature=0.5, seed=11, max_tokens=9)]
    runs = {}
    try:
        for on in (True, False):
            llm.async_scheduling = on
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            runs[on] = ([(c.token_ids, c.text, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                         for o in outs for c in o.outputs], llm.last_stats.ahead_steps)
    finally:
        llm.async_scheduling = True
    assert runs[True][1] > 5 and runs[False][1] == 0
    assert runs[True][0] == runs[False][0]
    assert llm.sched.bm.num_held == 0 or not llm.sched.has_unfinished()


def test_cpu_steps_skip_the_public_ops_and_match_them(llm, monkeypatch):
    """On the CPU a decode or prefill step's attention calls the torch code directly (where keys lie
    worked out once per step, not per layer; no pb.write_kv / pb.paged_decode / pb.paged_prefill
    with their input checks), and its outputs equal those of the public ops' path exactly:
    greedy and seeded samples, log-probabilities included."""
    import paged_backend as pb
    from paged_backend.integration import hf_attention
    calls = {"public": 0, "decode_plans": 0, "prefill_plans": 0}
    for name in ("write_kv", "paged_decode", "paged_prefill"):
        real = getattr(pb, name)
        monkeypatch.setattr(pb, name, lambda *a, _real=real, **k: calls.__setitem__("public", calls["public"] + 1)
                            or _real(*a, **k))
    for name, key in (("decode_chunks_torch", "decode_plans"), ("prefill_chunks_torch", "prefill_plans")):
        real = getattr(hf_attention, name)
        monkeypatch.setattr(hf_attention, name, lambda *a, _real=real, _key=key, **k: calls.__setitem__(
            _key, calls[_key] + 1) or _real(*a, **k))
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=20, ignore_eos=True)]  # (n=1: no cascade)
    fast = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    stats = llm.last_stats
    assert calls["public"] == 0
    assert calls["decode_plans"] == stats.decode_steps and calls["prefill_plans"] == stats.steps - stats.decode_steps
    monkeypatch.setattr(hf_attention, "_cpu_attend_qualifies", lambda step, query: False)  # the public ops' path
    slow = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert calls["public"] > 0
    assert [[(c.token_ids, c.cumulative_logprob, c.logprobs) for c in o.outputs] for o in fast] == \
        [[(c.token_ids, c.cumulative_logprob, c.logprobs) for c in o.outputs] for o in slow]


def test_cpu_decode_steps_run_on_one_thread(llm, monkeypatch):
    """A CPU step of fewer than CPU_SERIAL_TOKENS tokens runs with one torch thread (no OpenMP
    thread to spin or wake between its small ops); longer steps and the caller keep their count."""
    from paged_backend.integration import engine
    seen = []
    real = llm.model.forward
    monkeypatch.setattr(llm.model, "forward", lambda *a, **k: seen.append(
        (k["input_ids"].shape[1], torch.get_num_threads())) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        long = "Tell me a story about a dragon who learns to fly over the mountains at night."  # >= 8 tokens
        llm.generate(long, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen[0][0] >= engine.CPU_SERIAL_TOKENS and seen[0][1] == 2  # the prompt's prefill
    assert len(seen) == 4 and all(t == 1 for n, t in seen[1:] if n < engine.CPU_SERIAL_TOKENS)
