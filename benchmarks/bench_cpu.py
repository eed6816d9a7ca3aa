"""CPU end to end, one prompt (issue 39 item 2): ours against transformers ``generate`` on the same
model object, the same prompt and the same greedy tokens.

The embedded SmolLM2-135M-Instruct is loaded once through our loader (fp32, CPU); then, each timed
after a warm-up and reported as the median of ``--runs``:

- ``ours_api``: ``LLM(model, device="cpu", enable_prefix_caching=False)`` ``generate`` of one
  ~30-token prompt, 32 greedy tokens (``ignore_eos``; no prefix cache, so that every run prefills
  the whole prompt, as ``generate`` does);
- ``hf_generate``: transformers ``model.generate`` (a deepcopy of the same model with SDPA
  attention), ``max_new_tokens=32, do_sample=False``; its tokens must equal ours;
- ``ours_cli`` (``--cli``): ``paged-sample`` in a subprocess with the same prompt (raw text,
  greedy, ``--ignore-eos``), each run a fresh process with the caller's environment: its own
  "speed" line (one generate, model load excluded; the first generate of a process, so it pays
  what a warm-up hides).

tok/s = 32 / the whole call (prefill + decode); the two engines' runs alternate. Run it once with
``OMP_WAIT_POLICY`` unset and once with ``OMP_WAIT_POLICY=PASSIVE`` (separate processes: OpenMP
reads it once, when it starts); each run merges its rows into ``--out`` under its label and
rewrites the markdown table of every label next to it (``cpu_e2e.md``)::

    python benchmarks/bench_cpu.py --cli
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cpu.py --cli
"""
from __future__ import annotations

import os

CALLER_OMP = os.environ.get("OMP_WAIT_POLICY")  # as the caller set it, before anything imports torch

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who had a daughter. "
          "Every morning, before the sun rose, he")  # 32 tokens with SmolLM2's tokenizer
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "cpu_e2e.json")


def _rates(fns: dict, new: int, runs: int) -> dict:
    """tok/s of each of ``fns`` over ``runs`` runs after a warm-up, the engines' runs alternating
    (a busy host's load drifts)."""
    for fn in fns.values():
        fn()  # warm-up
    rates = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            rates[name].append(new / (time.perf_counter() - t0))
    return rates


def _cli_rates(prompt: str, new: int, runs: int, threads: int | None) -> list[float]:
    """tok/s from ``paged-sample``'s summary, one fresh process per run (the caller's environment)."""
    cmd = [sys.executable, "-m", "paged_backend.integration.cli", "--prompt", prompt, "--no-chat", "-t", "0",
           "--max-tokens", str(new), "--ignore-eos", "--device", "cpu", "-o", os.devnull]
    env = dict(os.environ)
    if CALLER_OMP is None:
        env.pop("OMP_WAIT_POLICY", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    rates = []
    for _ in range(runs):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        m = re.search(r"speed\s+([\d.]+) generated tokens/s", p.stderr)
        if p.returncode or not m:
            raise RuntimeError(f"paged-sample failed ({p.returncode}):\n{p.stderr[-2000:]}")
        rates.append(float(m.group(1)))
    return rates


def _table(runs: dict) -> str:
    """Markdown: one row per label (ours API, ours CLI, transformers, tok/s medians)."""
    lines = ["| run | ours API | ours CLI | transformers generate | threads | load avg | tokens equal |",
             "|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        rows = r["rows"]
        cell = lambda k: f"{rows[k]['tok_s']:.2f}" if k in rows else "-"  # noqa: E731
        lines.append(f"| {label} | {cell('ours_api')} | {cell('ours_cli')} | {cell('hf_generate')} | "
                     f"{r['torch_threads']} | {r['loadavg'][0]:.2f} | {r['tokens_equal']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per engine after a warm-up (default 5)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens to generate (default 32)")
    ap.add_argument("--cli", action="store_true", help="also time paged-sample (a process per run)")
    ap.add_argument("--cli-runs", type=int, default=3, help="paged-sample runs (default 3)")
    ap.add_argument("--label", default=None, help="this run's key in --out (default: from OMP_WAIT_POLICY)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON file to merge the rows into")
    args = ap.parse_args()

    import torch

    from paged_backend.integration import LLM, SamplingParams, models

    torch.set_num_threads(args.threads)
    with models.quiet_loading():
        info, _ = models.load(None, dtype=torch.float32, device=torch.device("cpu"), max_model_len=None)
    ref = copy.deepcopy(info.model)
    ref.set_attn_implementation("sdpa")
    llm = LLM(info.model, tokenizer=info.tokenizer, device="cpu", enable_prefix_caching=False)
    ids = info.tokenizer(PROMPT).input_ids
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    got = {}

    def ours():
        got["ours"] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids

    x = torch.tensor([ids])

    def hf():
        with torch.inference_mode():
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new, do_sample=False,
                               min_new_tokens=args.new, pad_token_id=info.tokenizer.eos_token_id)
        got["hf"] = out[0, x.shape[1]:].tolist()

    rows = {name: dict(tok_s=round(statistics.median(r), 2), runs=[round(v, 2) for v in r])
            for name, r in _rates({"ours_api": ours, "hf_generate": hf}, args.new, args.runs).items()}
    same = got["ours"] == got["hf"]
    if args.cli:
        rates = _cli_rates(PROMPT, args.new, args.cli_runs, None)
        rows["ours_cli"] = dict(tok_s=round(statistics.median(rates), 2), runs=[round(r, 2) for r in rates])

    label = args.label or f"OMP_WAIT_POLICY={CALLER_OMP or 'unset'}"
    load = os.getloadavg()
    payload = dict(prompt_tokens=len(ids), new_tokens=args.new, torch_threads=torch.get_num_threads(),
                   interop_threads=torch.get_num_interop_threads(), omp_wait_policy_caller=CALLER_OMP,
                   omp_wait_policy_in_process=os.environ.get("OMP_WAIT_POLICY"), tokens_equal=same,
                   loadavg=[round(v, 2) for v in load], torch=torch.__version__, cpus=os.cpu_count(),
                   machine=platform.processor() or platform.machine(),
                   date=datetime.datetime.now().isoformat(timespec="seconds"), rows=rows)
    print(f"threads {payload['torch_threads']} (interop {payload['interop_threads']}), OMP_WAIT_POLICY caller="
          f"{CALLER_OMP} in-process={payload['omp_wait_policy_in_process']}, load avg {load[0]:.2f}, "
          f"prompt {len(ids)} tokens, {args.new} new, tokens equal: {same}")
    md = ["| env | engine | tok/s (median) | runs |", "|---|---|---|---|"]
    for name, r in rows.items():
        md.append(f"| {label} | {name} | {r['tok_s']:.2f} | {', '.join(f'{v:.2f}' for v in r['runs'])} |")
    print("\n".join(md))

    data = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
    data.setdefault("runs", {})[label] = payload
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:  # every label's rows, one table
        f.write(_table(data["runs"]))
    if not same:
        print(f"TOKENS DIFFER:\n ours {got['ours']}\n hf   {got['hf']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
