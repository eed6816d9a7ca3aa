"""End-to-end parallel sampling: one 4K-token prompt, n = 64 samples, 256 new tokens each (no early
stop), bf16, on randomly initialised models of two shapes:

- ``smollm2-135m``: SmolLM2-135M's shape (30 layers, 9/3 heads of 64, vocab 49152; its GGUF is more
  than a device run can carry);
- ``llama3-8b-16l``: Llama-3-8B's shape cut to 16 layers (4.5 B parameters; 32/8 heads of 128,
  vocab 128256).

Engines, each on the same weights: ``ours`` (paged_backend.integration.LLM as it comes: flat decode
steps and cascade steps replay CUDA graphs, and samples sharing a prompt take the path whose steps
measure faster; on a GPU the model's layers compiled, integration/compiled.py),
``ours_cascade_graphs`` (every decode step a cascade, as ``ours`` runs them),
``ours_cascade_nocompile`` (the same, the layers not compiled), ``ours_cascade`` (every decode step
a cascade, all eager),
``ours_flat`` (every decode flat, in CUDA graphs), ``ours_flat_eager`` (flat, no graphs),
``hf_generate`` (transformers ``generate(num_return_sequences=64)`` with SDPA and its dense cache)
and ``hf_generate_batch`` (transformers' continuous batching with its paged cache; slow, so timed
on fewer new tokens and reported as a rate).

Per engine: tokens/s over the whole run, decode tokens/s, the median decode step against its bytes
floor (weights + the KV the step must read - for cascade the prompt once plus the tails - at the
copy bandwidth measured in the same run), the share of a decode step spent in attention and the
host's share, and peak GPU memory. Results: ``benchmarks/results/<gpu>.json`` (bench "e2e") and
``.md``.

``--prompts P`` (ours engines only): P distinct prompts of ``--prompt-len`` tokens, n samples each, prompt ``i``
stopping after ``new - i * (new // 2) // (P - 1)`` tokens - requests finish at different steps, so the
batch and the forest it shares change as they do (RL rollouts; ``graph_captures`` in the record counts the
CUDA graphs its steps captured). Its floors are the full batch's.

Each engine runs in a Python process of its own (``--same-process``: all in this one), on weights
made from the same seed: what one engine leaves behind - compiled code, Dynamo's caches and their
recompile limits, the allocator's pools - cannot move another's numbers (on an H200 the same engine
measured up to ~20% apart at different places in one process, 2026-11-28), and each is timed as a
user's first engine of a process runs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import common as C

from paged_backend.integration import LLM, SamplingParams

MODELS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0),
    "llama3-8b-16l": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                          max_position_embeddings=8192, rope_theta=500000.0),
}
QUICK_MODELS = {"tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)}
ENGINES = ("ours", "ours_cascade_graphs", "ours_cascade_nocompile", "ours_cascade", "ours_flat", "ours_flat_eager",
           "hf_generate", "hf_generate_batch")
OURS = {"ours": dict(), "ours_cascade_graphs": dict(always_cascade=True),
        "ours_cascade_nocompile": dict(always_cascade=True, compile_model=False), "ours_cascade": dict(enforce_eager=True),
        "ours_flat": dict(cascade=False),
        "ours_flat_eager": dict(cascade=False, enforce_eager=True)}  # LLM keyword arguments (always_cascade: ours)


def build(shape: dict, device, dtype, context: int):
    from transformers import AutoModelForCausalLM, LlamaConfig
    shape = dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], context))
    cfg = LlamaConfig(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights (the input embedding only gathers rows)."""
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is emb
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)


def kv_bytes_per_token(model) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2


def run_ours(model, prompts, n, new, kwargs: dict, device, sampling: dict) -> dict:
    """``prompts``: token id lists, ``n`` samples each, ``new`` tokens for the first and fewer for the
    others (``news``: ``--prompts``)."""
    kwargs = dict(kwargs)
    always = kwargs.pop("always_cascade", False)
    news = _news(new, len(prompts))
    llm = LLM(model, device=device, dtype=torch.bfloat16, max_num_seqs=n * len(prompts),
              max_model_len=len(prompts[0]) + new + 16, profile=True, **kwargs)
    if always and llm.choice is not None:  # every shared decode step a cascade (the choice never goes flat)
        llm.choice.PROBES = 2 ** 62
    # Warm-up on prompts as long as the timed one (no prefix-cache hit on it): the first as long as the
    # timed run, so every kernel specialisation its growing lengths take is compiled (and every graph
    # captured) before the clock starts; the second starts from a fresh prompt again.
    other = [[t - 1 for t in p] for p in prompts]  # (prompt ids are >= 10)
    llm.generate([{"prompt_token_ids": p} for p in other],
                 [SamplingParams(n=n, max_tokens=m, ignore_eos=True, seed=1, **sampling) for m in news], use_tqdm=False)
    llm.generate([{"prompt_token_ids": [t - 1 for t in p]} for p in other],
                 SamplingParams(n=n, max_tokens=4, ignore_eos=True, seed=2, **sampling), use_tqdm=False)
    _reset(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(n=n, max_tokens=m, ignore_eos=True, temperature=1.0, seed=0, **sampling)
                         for m in news], use_tqdm=False)
    wall = time.perf_counter() - t0
    st = llm.last_stats
    assert [sum(len(c.token_ids) for c in o.outputs) for o in outs] == [n * m for m in news]
    dec = [s for s in st.step_log if s["kind"] != "prefill"]
    def med(key):  # ms, median over the decode steps
        vals = [s[key] for s in dec if s[key] is not None]
        return statistics.median(vals) * 1e3 if vals else None

    rec = dict(wall_s=wall, tokens=n * sum(news), tok_s=n * sum(news) / wall, prefill_s=st.prefill_time,
               decode_s=st.decode_time,
               decode_tok_s=n * (sum(news) - len(news)) / st.decode_time if st.decode_time else None,
               decode_steps=len(dec), cascade_steps=st.cascade_steps, graph_captures=st.graph_captures,
               paths=" ".join(f"{k}x{len(list(g))}" for k, g in itertools.groupby(s["kind"] for s in dec)),
               graph_steps=sum(s["kind"] == "graph" for s in dec), step_ms=med("total_s"),
               step_gpu_ms=med("gpu_s"), step_host_ms=med("host_s"), attend_ms=med("attend_s"),
               gpu_idle_share=_idle_share(dec),
               peak_gib=_peak(device), kv_pool_gib=llm.cache.nbytes / 2 ** 30)
    del llm
    C.free_memory()
    return rec


def _news(new: int, prompts: int) -> list[int]:
    """New tokens of each of ``prompts`` prompts: ``new`` for the first, down to ``new - new // 2``."""
    return [new - i * (new // 2) // max(1, prompts - 1) for i in range(prompts)]


def run_hf_generate(model, prompt, n, new, device, sampling: dict) -> dict:
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=True, num_return_sequences=n, attention_mask=torch.ones_like(ids), pad_token_id=0,
              **{k: v for k, v in sampling.items() if k in HF_SAMPLING})
    model.generate(ids[:, :256], max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    _reset(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    _sync(device)
    prefill = time.perf_counter() - t0
    C.free_memory()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    _sync(device)
    wall = time.perf_counter() - t0
    assert out.shape == (n, len(prompt) + new)
    decode = wall - prefill
    rec = dict(wall_s=wall, tokens=n * new, tok_s=n * new / wall, prefill_s=prefill, decode_s=decode,
               decode_tok_s=n * (new - 1) / decode, step_ms=decode / (new - 1) * 1e3, peak_gib=_peak(device))
    del out
    C.free_memory()
    return rec


def run_hf_generate_batch(model, prompt, n, new, device) -> dict:
    from transformers import GenerationConfig
    model.set_attn_implementation("sdpa")
    gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, eos_token_id=None, pad_token_id=0)
    model.generate_batch([prompt[:128]] * 2, generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=True, eos_token_id=None, pad_token_id=0))  # warm-up
    _reset(device)
    t0 = time.perf_counter()
    res = model.generate_batch([list(prompt)] * n, generation_config=gen)
    _sync(device)
    wall = time.perf_counter() - t0
    got = sum(len(r.generated_tokens) for r in res.values())
    rec = dict(wall_s=wall, tokens=got, tok_s=got / wall, new_tokens_timed=new, peak_gib=_peak(device))
    C.free_memory()
    return rec


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _reset(device):
    """Synchronises and restarts the peak-memory count."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.device(device).type == "cuda" else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--engines", help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("-n", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--prompts", type=int, default=1,
                   help="distinct prompts, n samples each, finishing at different steps (ours engines only)")
    p.add_argument("--batch-new", type=int, default=16, help="new tokens for hf_generate_batch (it is slow)")
    p.add_argument("--quick", action="store_true", help="a tiny model and short run (smoke test)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/<gpu>.json)")
    p.add_argument("--md", help="markdown (default benchmarks/results/<gpu>.md)")
    p.add_argument("--sampling", default="", type=_sampling,
                   help="settings besides temperature 1 for every engine, e.g. top_p=0.9,top_k=50 (top_p, top_k, "
                        "min_p; logprobs: ours alone; hf_generate_batch: temperature alone)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--same-process", action="store_true", help="run every engine in this process")
    p.add_argument("--one", metavar="MODEL:ENGINE", help=argparse.SUPPRESS)  # (a child's run: prints its record)
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.n, args.new, args.batch_new = 300, 8, 16, 8
    if args.one:
        return _run_one(args)
    device = args.device
    models = QUICK_MODELS if args.quick else MODELS
    if args.models:
        bad = [m for m in args.models.split(",") if m not in models]
        if bad:
            p.error(f"unknown models {bad}; choose from {list(models)}")
        models = {k: models[k] for k in args.models.split(",")}
    engines = args.engines.split(",") if args.engines else [e for e in ENGINES if args.prompts == 1 or e in OURS]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        p.error(f"unknown engines {bad}; choose from {list(ENGINES)}")
    if args.prompts < 1 or (args.prompts > 1 and any(e not in OURS for e in engines)):
        p.error(f"--prompts must be >= 1, and above 1 only with the ours engines ({', '.join(OURS)})")
    bw = C.copy_bandwidth(device)
    print(f"{C.gpu_name()} copy bandwidth {bw:.0f} GB/s", flush=True)
    results, rows = {}, []
    for mname, shape in models.items():
        # (isolated engines build their own: this process only needs the shapes' byte counts)
        model = build(shape, "meta" if not args.same_process else device, torch.bfloat16, args.prompt_len + args.new + 64)
        prompts = make_prompts(shape, args.prompt_len, args.prompts)
        w, kvb = weight_bytes(model), kv_bytes_per_token(model)
        mid = args.prompt_len + args.new // 2  # a sequence's length halfway through decode
        rows_n = args.prompts * args.n  # (the full batch's)
        floor = {"flat": (w + rows_n * mid * kvb) / (bw * 1e9),
                 "unique": (w + args.prompts * (args.prompt_len + args.n * args.new // 2) * kvb) / (bw * 1e9)}
        results[mname] = {"params": sum(p.numel() for p in model.parameters()), "weight_bytes": w,
                          "kv_bytes_per_token": kvb, "floor_ms": {k: v * 1e3 for k, v in floor.items()}}
        for eng in engines:
            print(f"--- {mname} {eng}", flush=True)
            rec = run_engine(model, prompts, eng, args) if args.same_process else run_isolated(mname, eng, argv)
            fl = floor["unique" if eng == "ours_cascade" or rec.get("cascade_steps") else "flat"]
            if "step_ms" in rec:
                rec["floor_ms"] = fl * 1e3
                rec["step_vs_floor"] = rec["step_ms"] / (fl * 1e3)
            results[mname][eng] = rec
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
            rows.append(_row(mname, eng, rec))
        del model
        C.free_memory()
    payload = {"when": C.now(), "gpu": C.gpu_name(), "copy_gbps": bw, "versions": C.versions(),
               "workload": dict(prompt_len=args.prompt_len, n=args.n, new=args.new, batch_new=args.batch_new,
                                prompts=args.prompts,
                                dtype="bf16", sampling=args.sampling), "results": results}
    table = C.md_table(["model", "engine", "tok/s", "decode tok/s", "prefill s", "decode step ms (floor)",
                        "attention / host ms", "GPU idle", "peak GiB"], rows)
    print(table)
    if args.prompts > 1:
        workload = (f"{args.prompts} prompts of {args.prompt_len} tokens, n = {args.n} each, "
                    f"{' / '.join(map(str, _news(args.new, args.prompts)))} new tokens")
    else:
        workload = f"One {args.prompt_len}-token prompt, n = {args.n}, {args.new} new tokens each"
    if not args.quick:  # one section per set of models, so models can run in processes of their own
        many = f"{args.prompts}x" if args.prompts > 1 else ""
        slug, name = C.gpu_slug(), f"e2e:{','.join(models)}:{many}{args.prompt_len}x{args.n}x{args.new}"
        said = ",".join(f"{k}={v}" for k, v in args.sampling.items())
        name += f":{said}" if said else ""
        C.write_json(args.out or f"{C.ROOT}/benchmarks/results/{slug}.json", name, payload)
        C.write_md_section(args.md or f"{C.ROOT}/benchmarks/results/{slug}.md", name,
                           f"## End-to-end sampling: {', '.join(models)} ({C.gpu_name()}, {C.now()})\n\n"
                           f"{workload}, bf16, temperature 1{', ' + said if said else ''}; "
                           f"copy bandwidth {bw:.0f} GB/s. hf_generate_batch timed on {args.batch_new} new "
                           f"tokens.\n\n{table}\n")
    return 0


def run_engine(model, prompts, eng: str, args) -> dict:
    """One engine's record on ``model`` in this process ({"error": ...} where it failed); ``prompts``:
    one for the peers."""
    prompt = prompts[0]
    try:
        if eng in OURS:
            return run_ours(model, prompts, args.n, args.new, OURS[eng], args.device, args.sampling)
        if eng == "hf_generate":
            return run_hf_generate(model, prompt, args.n, args.new, args.device, args.sampling)
        return run_hf_generate_batch(model, prompt, args.n, args.batch_new, args.device)
    except Exception as e:  # noqa: BLE001 - a peer failing is a result, not the end of the run
        C.free_memory()
        return {"error": C.short_error(e)}


RECORD = "e2e-record: "  # the line a child process prints its record on


def run_isolated(mname: str, eng: str, argv) -> dict:
    """One engine's record from a Python process of its own (the same arguments, ``--one``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--one", f"{mname}:{eng}"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith(RECORD):
            return json.loads(line[len(RECORD):])
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"child process exited {r.returncode}: {tail[:300]}"}


def _run_one(args) -> int:
    """A child's run (``--one MODEL:ENGINE``): builds the model, runs the engine, prints its record."""
    mname, eng = args.one.split(":")
    models = QUICK_MODELS if args.quick else MODELS
    model = build(models[mname], args.device, torch.bfloat16, args.prompt_len + args.new + 64)
    rec = run_engine(model, make_prompts(models[mname], args.prompt_len, args.prompts), eng, args)
    print(RECORD + json.dumps(rec), flush=True)
    return 0


# the settings transformers' generate takes too
HF_SAMPLING = ("top_p", "top_k", "min_p")


def _sampling(text: str) -> dict:
    """``--sampling``: "top_p=0.9,top_k=50" -> {"top_p": 0.9, "top_k": 50}."""
    kinds = dict(top_p=float, top_k=int, min_p=float, logprobs=int)
    out = {}
    for part in filter(None, text.split(",")):
        name, _, val = part.partition("=")
        if name not in kinds:
            raise argparse.ArgumentTypeError(f"--sampling takes {', '.join(kinds)}, got {name!r}")
        try:
            out[name] = kinds[name](val)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sampling {name} must be a {kinds[name].__name__}, got {val!r}") from None
    return out


def _idle_share(steps: list) -> float | None:
    """The share of the decode steps' GPU clock (each step's span and the gap before it) in which
    the GPU had none of the engine's work: the gaps between steps, from CUDA events, no profiler."""
    timed = [s for s in steps if s.get("idle_s") is not None and s.get("gpu_s") is not None]
    busy, idle = sum(s["gpu_s"] for s in timed), sum(s["idle_s"] for s in timed)
    return idle / (busy + idle) if busy + idle > 0 else None


def make_prompts(shape: dict, length: int, count: int = 1) -> list[list]:
    """The run's prompts: token ids from fixed seeds (the same in every process), the first as one
    prompt always was; no two share a first token."""
    out = [torch.randint(10, shape["vocab_size"], (length,), generator=torch.Generator().manual_seed(1 + i)).tolist()
           for i in range(count)]
    for i, p in enumerate(out[1:], 1):
        p[0] = 10 + (out[0][0] - 10 + i) % (shape["vocab_size"] - 10)
    return out


def _row(model: str, eng: str, rec: dict) -> list:
    if "error" in rec:
        return [model, eng, "error: " + rec["error"][:80], "", "", "", "", "", ""]
    f = lambda v, d=0: "" if v is None else f"{v:,.{d}f}"  # noqa: E731
    step = f"{f(rec.get('step_ms'), 2)} ({f(rec.get('floor_ms'), 2)})" if "step_ms" in rec else ""
    share = f"{f(rec.get('attend_ms'), 2)} / {f(rec.get('step_host_ms'), 2)}" if "attend_ms" in rec else ""
    idle = rec.get("gpu_idle_share")
    return [model, eng, f(rec["tok_s"]), f(rec.get("decode_tok_s")), f(rec.get("prefill_s"), 2), step, share,
            "" if idle is None else f"{100 * idle:.1f}%", f(rec.get("peak_gib"), 1)]


if __name__ == "__main__":
    sys.exit(main())
