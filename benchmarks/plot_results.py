"""Plots of the saved benchmark results into docs/img/ (PNG).

    python3 benchmarks/plot_results.py [--gpu h200]

Reads benchmarks/results/<gpu>.json (decode, the e2e sampling runs) and parallel_<gpu>x{2,4}.json.
Needs matplotlib (the `bench` extra).
"""
from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
IMG = os.path.join(ROOT, "docs", "img")


def plot_decode(dec: dict, path: str) -> None:
    names = list(dec["cases"])
    # All from CUDA-graph replays (10 calls a graph), as an engine that captures its step sees them.
    impls = [("ours_sk@graph", "ours (stream-K)"), ("flashinfer@graph", "FlashInfer 0.2.14"),
             ("xformers@graph", "xformers 0.0.35 split-K"), ("sdpa@graph", "torch SDPA flash (dense KV)")]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(impls)
    for j, (key, label) in enumerate(impls):
        vals = [dec["cases"][c]["impls"].get(key, {}).get("pct_copy") or 0 for c in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"Paged decode in CUDA graphs, bf16 Hq32 Hkv8 D128 page 16 ({dec['device']}, "
                 f"copy {dec['copy_gbps']:.0f} GB/s)")
    ax.axhline(100, color="grey", lw=0.5)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_parallel(runs: dict, path: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, b in zip(axes, (1, 8)):
        for world, recs in sorted(runs.items()):
            for kind, style in (("tree", "-o"), ("ring", "--x"), ("single", ":s")):
                if kind == "single" and world != max(runs):
                    continue
                pts = sorted((r["ctx"], r["latency_us"]) for r in recs
                             if r.get("kind") == kind and r.get("B") == b and r.get("strategy", "auto") == "auto")
                if pts:
                    label = "one GPU" if kind == "single" else f"{kind}, {world} GPUs"
                    ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (K tokens)")
        ax.set_title(f"B = {b}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode latency (us)")
    axes[1].legend(fontsize=8)
    fig.suptitle("Sequence-parallel decode on H200s (NCCL, NVLink): tree merge vs ring vs one GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_e2e(runs: dict, path: str) -> None:
    """Generated tokens/s per engine, one panel per model of each e2e run (model x workload)."""
    panels = [(run, model, res) for _, run in sorted(runs.items()) for model, res in run["results"].items()]
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (run, model, res) in zip(axes.flat, panels):
        engines = [e for e in ("ours", "ours_cascade_graphs", "ours_flat", "ours_cascade", "ours_flat_eager",
                               "vllm", "hf_generate", "hf_generate_batch") if isinstance(res.get(e), dict)]
        vals = [res[e].get("tok_s", 0.0) for e in engines]
        colors = ["#1f77b4" if e.startswith("ours") else "#aaaaaa" for e in engines]
        ax.barh(engines[::-1], vals[::-1], color=colors[::-1])
        for y, (e, v) in enumerate(zip(engines[::-1], vals[::-1])):
            ax.text(v, y, f" {v:,.0f}" if v else " out of memory", va="center", fontsize=8)
        w = run["workload"]
        sampling = ", ".join(f"{k}={v}" for k, v in sorted(w.get("sampling", {}).items()))
        ax.set_title(f"{model}: {w['prompt_len']} x {w['n']} x {w['new']}" + (f" ({sampling})" if sampling else ""),
                     fontsize=9)
        ax.set_xlabel("generated tokens / s")
        ax.set_xlim(0, max(vals + [1.0]) * 1.3)
    gpu = panels[0][0].get("gpu", "GPU")
    fig.suptitle(f"Parallel sampling end to end (prompt tokens x samples x new tokens, bf16, {gpu})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h200")
    args = ap.parse_args()
    os.makedirs(IMG, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.gpu}.json")) as f:
        bench = json.load(f)["benchmarks"]
    plot_decode(bench["decode"], os.path.join(IMG, f"decode_{args.gpu}.png"))
    e2e = {k: v for k, v in bench.items() if k.startswith("e2e:")}
    if e2e:
        plot_e2e(e2e, os.path.join(IMG, f"e2e_{args.gpu}.png"))
    runs = {}
    for world in (2, 4):
        p = os.path.join(RESULTS, f"parallel_{args.gpu}x{world}.json")
        if os.path.exists(p):
            with open(p) as f:
                runs[world] = json.load(f)["records"]
    if runs:
        plot_parallel(runs, os.path.join(IMG, f"parallel_{args.gpu}.png"))
    print("wrote", sorted(os.listdir(IMG)))


if __name__ == "__main__":
    main()
