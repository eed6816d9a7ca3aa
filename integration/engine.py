"""The offline engine: ``LLM(model).generate(prompts, SamplingParams(...))``, as in vLLM.

One step, each arrow one module::

    scheduler.schedule() -> ScheduledBatch (host arrays)
      -> StepBuilder.build: device copies + one plan for the step       (step.py)
      -> the model's own forward; attention through the paged ops       (hf_attention.py)
      -> Sampler: every sample row in one batched call on the device    (sampler.py)
      -> scheduler.postprocess -> finished requests -> RequestOutput    (outputs.py)

The scheduler owns requests, blocks, prefix caching, forks for ``n``, copy-on-write, chunked
prefill and preemption; the engine owns the model, the KV cache tensors and the sampling.
"""
from __future__ import annotations

import logging
import time
from typing import Iterator

import numpy as np
import torch

from paged_backend.cascade import CascadeCost
from paged_backend.scheduler import BlockManager, SamplingParams, Scheduler
from paged_backend.scheduler.scheduler import FINISHED

from . import hf_attention, models
from .cascade_graphs import CascadeGraphs
from .collector import PausedCollector
from .compiled import CompiledForward
from .graphs import DecodeGraphs, padded_sizes
from .path_choice import PathChoice
from .launched import Launched
from .kv_cache import KVCacheSpec, PagedKVCache, blocks_for
from .outputs import RequestOutput, RunStats
from .requests import Request, RequestMaker, chat_prompts
from .sampler import Sampler
from .sample_book import SampleBook
from .weights import WeightWatch
from .step import CASCADE, StepBuilder

GRAPH = "graph"  # a decode step replayed from a CUDA graph

log = logging.getLogger("paged_backend")


class LLM:
    """An offline engine over a transformers causal LM whose attention runs on paged-backend.

    model: None (the embedded SmolLM2-135M-Instruct GGUF, see ``models``), a local Hugging Face
    model directory, a ``.gguf`` file, or an already loaded ``transformers`` causal LM (then pass
    its ``tokenizer`` too, or prompts as token ids). dtype: "auto" (fp32 on the CPU, bf16 on a
    GPU), or fp32/fp16/bf16. device: default "cuda" when available. block_size: tokens per KV
    block. num_blocks or kv_memory_fraction: the KV pool, in blocks or as a fraction of the memory
    free after loading (default 0.9 on a GPU, 0.25 on the CPU). max_num_seqs: sequences per step
    (a request counts its n samples). max_model_len: prompt + output tokens per sequence (default:
    the model's context). max_num_batched_tokens: tokens per step (prefill chunks + decodes).
    cascade: decode samples that share a prompt with ``pb.cascade_decode`` (a shared prefix read
    once, where its cost model says it pays; a ``CascadeCost`` replaces that model, its
    ``kv_elem_bytes`` the cache's: 1 with an fp8 cache) - False runs
    every decode flat. seed: the seed of requests that give none. enforce_eager: on a GPU, decode
    steps replay CUDA graphs of the model unless this is True, attention included: flat steps from
    graphs captured for every padded batch size up to ``max_num_seqs`` when the engine starts (a
    progress bar on a terminal), cascade steps from graphs captured with the first step of each
    shape of plan (:mod:`.cascade_graphs`; not counted in the path choice's timings). profile: record each step's host and GPU time in ``last_stats.step_log``
    (CUDA events; for benchmarks). kv_cache_dtype: "auto" (the model's dtype) or "fp8" (e4m3;
    "fp8_e5m2" too): half the KV bytes per token, so twice the pool and half the bytes every decode
    step reads; K/V are stored with per-tensor scales of 1.0 (vLLM's default without calibration).
    async_scheduling: while a decode step runs, schedule and launch the next one (its input ids are
    the running step's tokens, read on the device), then book the running step's tokens: the host's
    work overlaps the device's (as vLLM's async scheduling). Only while every running sample
    decodes, nothing waits and no preemption is needed; a sample that stops on EOS or a stop string
    runs one step more, whose token is dropped. Outputs are the same either way.
    compile_model: compile each decoder layer with ``torch.compile`` (Inductor), attention left out
    (:mod:`.compiled`): the model's norms, RoPE and residuals fused. Default: on a GPU unless
    ``enforce_eager``; a string or callable names another ``torch.compile`` backend (tests:
    "aot_eager"). The model object itself is not changed (its own calls stay uncompiled).
    """

    def __init__(self, model=None, *, tokenizer=None, dtype="auto", device=None, block_size: int = 16,
                 num_blocks: int | None = None, kv_memory_fraction: float | None = None, max_num_seqs: int = 256,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, cascade: bool | CascadeCost = True, seed: int = 0,
                 enforce_eager: bool = False, profile: bool = False, kv_cache_dtype: str = "auto",
                 async_scheduling: bool = True, compile_model=None):
        if compile_model is not None and not isinstance(compile_model, (bool, str)) and not callable(compile_model):
            raise TypeError(f"compile_model must be None, a bool, a torch.compile backend's name or a callable backend, "
                            f"got {type(compile_model).__name__}")
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = models.pick_dtype(dtype, self.device)
        if isinstance(model, torch.nn.Module):
            hf_attention.register()
            model.set_attn_implementation(hf_attention.ATTN_IMPLEMENTATION)
            model = model.to(device=self.device, dtype=self.dtype).eval()
            self.info, self.max_model_len = models.describe(model, tokenizer, type(model).__name__, max_model_len)
        else:
            self.info, self.max_model_len = models.load(model, dtype=self.dtype, device=self.device,
                                                        max_model_len=max_model_len)
        self.model, self.tokenizer = self.info.model, self.info.tokenizer
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size > 256 \
                or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in 1..256, got {block_size!r}")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        spec = KVCacheSpec(self.info.num_layers, self.info.num_kv_heads, self.info.head_dim, block_size,
                           models.pick_kv_cache_dtype(kv_cache_dtype, self.dtype), self.device)
        useful = max_num_seqs * -(-self.max_model_len // block_size) + 1
        self.cache = PagedKVCache(spec, blocks_for(spec, num_blocks=num_blocks, kv_memory_fraction=kv_memory_fraction,
                                                   max_useful_blocks=useful))
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(8192 if self.device.type == "cuda" else 2048, max_num_seqs)
        self._sched_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=self.max_model_len, detokenize=self._detokenize if self.tokenizer else None)
        self._prefix_caching = enable_prefix_caching
        self._new_scheduler()
        self.builder = StepBuilder(self.cache, num_q_heads=self.info.num_q_heads, cascade=bool(cascade),
                                   cascade_cost=cascade if isinstance(cascade, CascadeCost) else None,
                                   windows=self.info.windows)
        self.sampler = Sampler(self.info.vocab_size, self.device)
        if compile_model is None:
            compile_model = self.device.type == "cuda" and not enforce_eager
        self.forward = self.model  # what runs the model: the model, or its layers compiled (the model unchanged)
        if compile_model:
            self.forward = CompiledForward.of(self.model, **({} if compile_model is True else {"backend": compile_model}))
        self.graphs = self.cascades = self.choice = None
        self.weights = WeightWatch(self.model)  # what the graphs and the prefix cache were made with
        if not enforce_eager and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self.forward, self.cache, num_q_heads=self.info.num_q_heads,
                                       max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                       windows=self.info.windows, sample=self.sampler.sample)
            self.cascades = CascadeGraphs(self.forward, self.cache, self.builder, max_num_seqs=max_num_seqs,
                                          max_model_len=self.max_model_len, sample=self.sampler.sample)
            self.choice = PathChoice(self.model, spec.bytes_per_block // block_size, self.device)
            self._capture(max_num_seqs)
        self.requests = RequestMaker(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids,
                                     np.random.default_rng(seed))
        self.profile = profile
        self.async_scheduling = bool(async_scheduling)
        self.last_stats = RunStats()

    # ------------------------------------------------------------------ public API
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to the end -> one :class:`RequestOutput` per prompt, in input order.

        prompts: a str, ``{"prompt": str}``, ``{"prompt_token_ids": [int, ...]}``, or a list of
        those. sampling_params: one for all, or one per prompt (default ``SamplingParams()``).
        Malformed prompts or parameters raise before anything runs; a request over the engine's
        limits (``max_model_len``, the KV pool, ``max_num_seqs`` for ``n``) comes back with
        ``error`` set while the others run."""
        reqs = self.requests.make(prompts, sampling_params)
        outs = {o.request_id: o for o in self._run(reqs, use_tqdm)}
        return [outs[r.request_id] for r in reqs]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """``generate`` on conversations (a list of ``{"role", "content"}`` dicts, or a list of
        them) through the model's chat template."""
        return self.generate(self.chat_prompts(messages, add_generation_prompt=add_generation_prompt,
                                               chat_template_kwargs=chat_template_kwargs),
                             sampling_params, use_tqdm)

    def chat_prompts(self, messages, *, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict | None = None) -> list[dict]:
        """Conversations -> prompts for :meth:`generate` (the template's text and its token ids)."""
        return chat_prompts(self.tokenizer, self.info.name, messages, add_generation_prompt=add_generation_prompt,
                            chat_template_kwargs=chat_template_kwargs)

    def generate_iter(self, prompts, sampling_params=None, *, use_tqdm: bool = False,
                      request_ids: list[str] | None = None) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yields each request's output as soon as it finishes (rejected
        requests first). Closing the iterator early aborts the requests still running. Prompts
        and parameters are checked here, before the first output."""
        return self._run(self.requests.make(prompts, sampling_params, request_ids), use_tqdm)

    def _run(self, reqs: list[Request], use_tqdm: bool) -> Iterator[RequestOutput]:
        stats = self.last_stats = RunStats(num_requests=len(reqs), num_kv_blocks=self.cache.num_blocks,
                                           kv_block_bytes=self.cache.spec.bytes_per_block)
        t_start = time.perf_counter()
        hits_before, self._preemptions_before = self.sched.bm.prefix_hit_tokens, self.sched.num_preemptions
        bar = _progress(len(reqs), use_tqdm)
        live: set[str] = set()
        step = None  # the step in flight
        paused = PausedCollector()  # (no collections on the step loop's path; restored in finally)
        try:
            for r in reqs:
                try:
                    self.sched.add_request(r.token_ids, r.params, request_id=r.request_id)
                except ValueError as e:  # over a limit of this engine: this request only
                    with paused.resumed():
                        yield self._rejected(r, e, stats, bar)
                    continue
                try:  # its sampling settings, checked before any step: a bad one fails this request only
                    self.samples.add(r)
                except (ValueError, TypeError, OverflowError) as e:
                    self.samples.drop(self.sched.abort(r.request_id))
                    with paused.resumed():
                        yield self._rejected(r, e, stats, bar)
                    continue
                live.add(r.request_id)
                self._live[r.request_id] = r
                stats.num_samples += r.params.n
                stats.prompt_tokens += len(r.token_ids)
            self._last_finish, self._last_events = t_start, None
            if self.choice is not None:
                self.choice.new_run()
            self._ready()
            while step is not None or self.sched.has_unfinished():
                if step is None:
                    step = self._launch(self._schedule(), None)
                ahead = None
                if self.async_scheduling and self.sched.can_run_ahead(step.batch):
                    self.sched.run_ahead(step.batch)  # the next step runs while this one's tokens come back
                    ahead = self._launch(self._schedule(), step)
                    stats.ahead_steps += 1
                done = self._finish(step, stats, ahead is not None and ahead.captured)
                step = ahead
                for g in done:
                    live.discard(g.request_id)
                    self.sched.requests.pop(g.request_id, None)
                    out = self.samples.output(g, self._live.pop(g.request_id),
                                              self._detokenize if self.tokenizer is not None else None,
                                              self.info.eos_token_ids)
                    stats.generated_tokens += sum(len(c.token_ids) for c in out.outputs)
                    stats.cached_prompt_tokens = self.sched.bm.prefix_hit_tokens - hits_before
                    stats.wall_time = time.perf_counter() - t_start
                    bar.update(1)
                    bar.set_postfix_str(f"{stats.tokens_per_s:.1f} tok/s", refresh=False)
                    with paused.resumed():
                        yield out
        finally:
            if step is not None:  # closed early with a step in flight: its KV writes land first
                step.wait()
            stats.wall_time = time.perf_counter() - t_start
            bar.close()
            for rid in live:  # closed early: the step boundary is behind us, so blocks free safely
                if rid in self.sched.requests:
                    self.samples.drop(self.sched.abort(rid))
                self._live.pop(rid, None)
            paused.restore()

    def _rejected(self, r: Request, e: Exception, stats: RunStats, bar) -> RequestOutput:
        stats.num_rejected += 1
        log.warning("request %s rejected: %s", r.request_id, e)
        bar.update(1)
        return RequestOutput(r.request_id, r.prompt, r.token_ids, [], error=str(e))

    # ------------------------------------------------------------------ one step
    def _schedule(self):
        batch = self.sched.schedule()
        if batch.is_empty:
            raise RuntimeError("the scheduler made no progress with requests pending (a bug: please report it)")
        return batch

    def _launch(self, batch, prev: Launched | None) -> Launched:
        """Queues ``batch``'s forward and draw on the device. ``prev``: the step in flight whose
        tokens are this decode-only step's input ids (``Scheduler.run_ahead``), or None."""
        t0 = time.perf_counter()
        captured = self._graphs_made()
        events = _events(self.device) if self.profile else None
        threads = _serial_cpu_step(self.device, batch.num_tokens)
        try:
            self.cache.copy_blocks(batch.block_copies)
            rows, fork = self.samples.rows(batch)
            # a decode step's graph draws its rows (unless they fork: the sampler draws after the graph)
            draw = (self.sampler.settings(rows), rows.key) if fork is None and rows.key.size else None
            kind, logits, drawn = self._forward(batch, events, None if prev is None else _ids_from(prev, batch), draw)
            with torch.inference_mode():
                if fork is not None:
                    logits = logits.repeat_interleave(torch.from_numpy(fork).to(logits.device), dim=0,
                                                      output_size=int(fork.sum()))
                sampled = drawn if drawn is not None else self.sampler(logits, rows)
                t_issued = time.perf_counter()
                if events:
                    events[1].record()
                launched = Launched.start(batch, kind, sampled, t0, t_issued, captured != self._graphs_made(), events)
                launched.attend_events = self._attend_events
                return launched
        except BaseException:
            if prev is not None:
                prev.wait()
            self._new_scheduler()  # the step's KV may be half written: drop every block and cached prefix
            raise
        finally:
            if threads:
                torch.set_num_threads(threads)

    def _finish(self, step: Launched, stats: RunStats, capture_beside: bool = False):
        """Waits for ``step``'s tokens and books them -> the groups that finished. ``capture_beside``:
        the step launched while this one ran captured a graph (this one's time holds that capture)."""
        sched, batch = self.sched, step.batch
        tokens, logprobs, top = step.wait()
        stale = np.fromiter((s.status is FINISHED for s in batch.seqs), bool, len(batch.seqs))  # ended before
        done = sched.postprocess(batch, tokens)
        self.samples.record(batch, tokens, logprobs, top, stale)
        now = time.perf_counter()
        dt = now - max(step.t0, self._last_finish)  # (steps overlap: each counts from the last one's end)
        self._last_finish = now
        if self.choice is not None and not (step.captured or capture_beside):  # (a capture is not a step's time)
            if step.kind == CASCADE:
                self.choice.note_cascade(dt)
            elif step.kind == GRAPH:
                self.choice.note_flat(dt, batch)
        if self.profile:
            gpu = attend = idle = None
            if step.events:
                step.events[1].synchronize()  # (a step of prefill chunks copies nothing back: no sync)
                gpu = step.events[0].elapsed_time(step.events[1]) / 1e3
                if step.attend_events:
                    attend = sum(a.elapsed_time(b) for a, b in step.attend_events) / 1e3
                if self._last_events is not None:  # the GPU clock from the last step's end to this one's start
                    idle = self._last_events[1].elapsed_time(step.events[0]) / 1e3
                self._last_events = step.events
            stats.step_log.append(dict(kind=step.kind, rows=len(batch.seqs), tokens=batch.num_tokens,
                                       host_s=step.t_issued - step.t0, total_s=dt, gpu_s=gpu, attend_s=attend,
                                       idle_s=idle))
        stats.steps += 1
        stats.graph_captures += step.captured
        if batch.num_prefill_tokens:
            stats.prefill_time += dt
        else:
            stats.decode_time += dt
            stats.decode_steps += 1
            stats.cascade_steps += step.kind == CASCADE
        bm = sched.bm
        used = bm.num_blocks - bm.num_free_blocks
        stats.peak_kv_blocks = max(stats.peak_kv_blocks, used)
        stats.peak_shared_bytes = max(stats.peak_shared_bytes, (bm.num_held - used) * bm.bytes_per_block)
        stats.preemptions = sched.num_preemptions - self._preemptions_before
        return done

    def _forward(self, batch, events, ids: torch.Tensor | None, draw=None):
        """The model on one step -> (how attention ran: DECODE, CASCADE, PREFILL or GRAPH, logits [R, V],
        the rows' ``Sampled`` where a graph drew them, else None). ``draw``: the rows' (SampleSettings,
        noise keys) where a graph may draw them, or None.
        On a GPU decode steps replay a CUDA graph: flat ones (:mod:`.graphs`), and cascade ones where
        their rows share blocks and the cascade pays (:mod:`.cascade_graphs`); the rest run eagerly.
        ``ids`` [B] int64 on the device: the input ids of a decode-only step run ahead (its batch
        holds placeholders), or None. ``events``: (start, end) CUDA events (profiling: start is
        recorded once the step is planned, just before its model runs; each layer's attention is
        timed in eager steps), or None."""
        self._attend_events = None
        mark = None if events is None else events[0].record
        if not batch.num_prefill_tokens and self.graphs is not None:
            if self.builder.wants_cascade(batch) and self.choice.cascade(batch):
                out = self.cascades.run(batch, ids, mark, draw)  # (None: no node pays, or too large for a graph)
                if out is not None:
                    return CASCADE, *out
            out = self.graphs.run(batch, ids, mark, draw)
            if out is not None:
                return GRAPH, *out
        step = self.builder.build(batch)
        if ids is not None:
            step.input_ids[0, :ids.numel()].copy_(ids)
        if events is not None:
            step.attend_events = self._attend_events = []
            mark()
        with torch.inference_mode():
            logits = self.forward(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                                logits_to_keep=step.logits_indices, paged_step=step).logits[0]
        return CASCADE if step.is_cascade else step.kind, logits, None

    def _capture(self, max_num_seqs: int) -> None:
        """Captures the flat decode steps of every padded batch size now, so that no user's step pays
        a capture (a cascade step's graph is captured with the first step of its launch key)."""
        from tqdm.auto import tqdm
        sizes = padded_sizes(max_num_seqs)
        with tqdm(total=len(sizes), desc="Capturing CUDA graphs", unit="graph", leave=False,
                  disable=None) as bar:  # (disable=None: no bar where stderr is not a terminal)
            for size in sizes:
                self.graphs.graph(size)
                bar.update(1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_prefix_cache(self) -> bool:
        """Forgets the KV of every cached prompt block (vLLM's call of the same name): after weights
        were written in a way the engine cannot see (``p.data.copy_(t)``: see :meth:`_ready`).
        Between calls only: -> False (nothing done) while requests hold blocks."""
        return self.sched.bm.reset_prefix_cache()

    def sleep(self) -> None:
        """Frees the engine's device memory but the model's - the KV pool (the prefix cache's contents
        with it), the CUDA graphs and their buffers - while the device does other work (an RL loop
        training the model between calls). The next call, or :meth:`wake_up`, makes them again (the
        flat graphs captured anew). Between calls only: ``RuntimeError`` while requests hold blocks."""
        if self.sched.bm.num_held:
            raise RuntimeError("sleep() while requests hold KV blocks: finish or close the running generate_iter first")
        self._drop_graphs()
        self.builder.reset()
        self.cache.release()
        self.sched.bm.reset_prefix_cache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """After :meth:`sleep`: the KV pool allocated and the flat decode graphs captured now, rather
        than in the next call (which does it otherwise); nothing when awake."""
        self._ready()

    def _ready(self) -> None:
        """Before a call's first step: the engine woken if asleep, and where the model's tensors
        changed since the last call (:class:`.weights.WeightWatch`), the prefix cache dropped (its KV
        came from the old weights), and where one was re-pointed the CUDA graphs captured again (they
        read each weight at its old address, memory freed since). Writes through ``.data`` are not
        seen: call :meth:`reset_prefix_cache` after those."""
        projections = getattr(self.forward, "projections", None)
        if projections is not None:  # (the joined projections put back end to end first: their new place counts)
            projections.keep()
        changed, moved = self.weights.look()
        asleep = self.cache.kv is None
        if not (asleep or changed):
            return
        if asleep:
            self.cache.allocate()
        if not self.sched.bm.reset_prefix_cache():
            log.warning("the model's weights changed while requests hold KV blocks: the prefix cache is kept")
        if (asleep or moved) and self.graphs is not None:
            if moved:
                log.info("the model's weights moved since its CUDA graphs were captured: capturing them again")
            self._drop_graphs()
            self._capture(self._sched_args["max_num_seqs"])

    def _drop_graphs(self) -> None:
        """Every CUDA graph (flat and cascade) dropped: the next use of a shape captures it again."""
        for graphs in (self.graphs, self.cascades):
            if graphs is not None:
                graphs.reset()

    def _graphs_made(self) -> int:
        """CUDA graphs captured so far (flat decode steps and cascade steps)."""
        return (0 if self.graphs is None else self.graphs.captures) + (0 if self.cascades is None else
                                                                          self.cascades.captures)

    def _detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_scheduler(self) -> None:
        bm = BlockManager(self.cache.num_blocks, self.cache.spec.block_size, watermark=0.01,
                          enable_prefix_caching=self._prefix_caching, bytes_per_block=self.cache.spec.bytes_per_block)
        self.sched = Scheduler(bm, **self._sched_args)
        self._preemptions_before = 0
        self._live: dict[str, Request] = {}  # requests added and not finished
        self.samples = SampleBook()


# On the CPU a step of fewer tokens than this (decode of a few sequences) runs on one thread: its
# matrix-vector products are memory-bound and MKL runs them on one thread anyway (2 cores: the
# same time at 1 or 2 threads; from 8 rows on, 2 threads pay), while each parallel region of the
# step's small ops (attention, the sampler's reductions) wakes or spins the other OpenMP thread.
# With OpenMP's default wait policy that thread spins between regions and steals a busy host's
# other core: SmolLM2-135M, 2 cores with one core loaded, 8 -> 23 tok/s (transformers' generate
# at 2 threads: 8.5); an idle host runs at the same speed either way.
CPU_SERIAL_TOKENS = 8


def _ids_from(prev: Launched, batch) -> torch.Tensor:
    """The input ids [B] on the device of ``batch``, a step run ahead of ``prev``: ``prev``'s tokens,
    those of its rows that go on (``Scheduler.run_ahead`` leaves out samples ending by length)."""
    was, now = prev.batch.seq_ids, batch.seq_ids
    if len(now) == len(was):
        return prev.tokens
    order = np.argsort(was)
    at = order[np.minimum(np.searchsorted(was, now, sorter=order), len(was) - 1)]
    if not np.array_equal(was[at], now):
        raise RuntimeError("a step run ahead holds a row the step before it lacks (a bug: please report it)")
    index = torch.from_numpy(at)
    if prev.tokens.is_cuda:  # (pinned: a pageable copy would wait for the step in flight)
        index = index.pin_memory().to(prev.tokens.device, non_blocking=True)
    return prev.tokens[index]


def _serial_cpu_step(device: torch.device, num_tokens: int) -> int:
    """On the CPU, for a step of fewer than ``CPU_SERIAL_TOKENS`` tokens: torch's intra-op threads
    set to 1 -> the count to restore after the step; otherwise 0 (nothing changed)."""
    if device.type != "cpu" or num_tokens >= CPU_SERIAL_TOKENS:
        return 0
    threads = torch.get_num_threads()
    if threads == 1:
        return 0
    torch.set_num_threads(1)
    return threads


def _events(device: torch.device):
    """(start, end) CUDA events (recorded by the step: start just before its model runs, end after
    its draw), or None off the GPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _progress(total: int, enabled: bool):
    """A tqdm bar over requests (a stand-in with the same methods when disabled)."""
    if enabled:
        from tqdm.auto import tqdm
        return tqdm(total=total, unit="req", desc="Generating", dynamic_ncols=True)

    class _Off:
        def update(self, n=1): pass
        def set_postfix_str(self, s, refresh=True): pass
        def close(self): pass
    return _Off()
