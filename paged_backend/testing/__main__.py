"""``python -m paged_backend.testing --impl ours|sdpa|flashinfer|xformers|module:attr [--device D]
[--quick] [--case NAME ...] [--json PATH] [-v]``: runs the conformance cases against one implementation,
prints a table (case, passed / failed / not supported, errors); exit status 1 if any case failed."""
from __future__ import annotations

import argparse
import json
import sys

from .suite import FAILED, as_dicts, default_device, format_table, run_suite


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paged_backend.testing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="ours",
                    help="ours, sdpa, flashinfer, xformers, or module:attr (your Adapter class or object)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--quick", action="store_true", help="the small subset (every op, the main features once)")
    ap.add_argument("--case", action="append", default=None, help="run only these cases (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also save the results as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line on stderr as each case ends")
    args = ap.parse_args(argv)
    device = args.device or default_device()
    said = (lambda r, s: print(f"{r.case}: {r.status} ({s:.1f} s)", file=sys.stderr, flush=True)) if args.verbose else None
    results = run_suite(args.impl, device, quick=args.quick, cases=args.case, seed=args.seed, on_result=said)
    print(format_table(results, f"paged_backend.testing: impl={args.impl} device={device}"
                                f"{' (quick)' if args.quick else ''}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(impl=args.impl, device=device, quick=args.quick, seed=args.seed,
                           results=as_dicts(results)), f, indent=1)
    return 1 if any(r.status == FAILED for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
