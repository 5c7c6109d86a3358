"""``meshserve trace``: where a request's time went, from the trace store.

    meshserve trace ID                     one trace (a trace id, a traceparent, or an
                                           OpenAI id such as chatcmpl-<trace id>)
    meshserve trace --last [--model M]     the newest trace
    meshserve trace --slowest N [--model M] [--status error]   the N slowest
    ... [--json] [--url http://127.0.0.1:16686]

One row per span (Envoy, the adapter, the orchestrator, each ensemble step,
each stage) on the trace's time axis, with each stage's queue and compute
time and the network + serialisation time between a caller's span and the
callee's server span (services/tracestore/waterfall.py). ``--url`` is the
trace store's query port, or the edge (Envoy routes /traces there).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from services.tracestore.waterfall import Waterfall, render

DEFAULT_URL = "http://127.0.0.1:16686"
"""The trace store's query port in deploy/local/mesh.yaml."""
TIMEOUT_S = 10.0
_TRACE_ID = re.compile(r"[0-9a-fA-F]{32}")


class TraceNotFound(Exception):
    """The store has no such trace (yet)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``meshserve trace``'s flags."""
    parser.add_argument(
        "trace_id",
        nargs="?",
        help="trace id (32 hex digits), a whole traceparent, or an id such as chatcmpl-<id>",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--last", action="store_true", help="show the newest trace")
    which.add_argument("--slowest", type=int, metavar="N", help="show the N slowest traces")
    parser.add_argument("--model", help="with --last / --slowest: only traces of this model")
    parser.add_argument(
        "--status", choices=["ok", "error"], help="with --last / --slowest: only these traces"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a waterfall")
    parser.add_argument(
        "--wait-s",
        type=float,
        default=3.0,
        help="wait this long for a trace that has not reached the store yet (default: %(default)s)",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="the trace store's query address, or the edge's (default: %(default)s)",
    )


def parse_trace_id(text: str) -> str:
    """The trace id in ``text`` (bare, in a traceparent, or after an id's prefix)."""
    found = _TRACE_ID.search(text)
    if found is None:
        raise ValueError(f"{text!r} holds no trace id (32 hex digits)")
    return found.group(0).lower()


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise TraceNotFound(url) from exc
        raise


def fetch(base: str, trace_id: str, wait_s: float) -> Waterfall:
    """One trace's waterfall; waits up to ``wait_s`` for it to arrive."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Waterfall.from_json(_get(f"{base}/traces/data/waterfall/{trace_id}"))
        except TraceNotFound:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.25)


def listed(base: str, args: argparse.Namespace, limit: int) -> list[str]:
    """Trace ids of the newest or slowest traces that match the filters."""
    query = {"order": "recent" if args.last else "slowest", "limit": str(limit)}
    if args.model:
        query["model"] = args.model
    if args.status:
        query["status"] = args.status
    answer = _get(f"{base}/traces/data/list?{urllib.parse.urlencode(query)}")
    return [row["trace_id"] for row in answer["traces"]]


def trace(args: argparse.Namespace) -> int:
    """Show where a request's time went: one trace, the newest, or the slowest."""
    base = args.url if "://" in args.url else f"http://{args.url}"
    base = base.rstrip("/")
    try:
        if args.trace_id:
            ids = [parse_trace_id(args.trace_id)]
        elif args.last or args.slowest:
            ids = listed(base, args, 1 if args.last else args.slowest)
            if not ids:
                print("no trace matches", file=sys.stderr)
                return 1
        else:
            print("error: give a trace id, --last or --slowest N", file=sys.stderr)
            return 2
        falls = [fetch(base, trace_id, args.wait_s) for trace_id in ids]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TraceNotFound:
        print(f"error: the trace store at {base} has no trace {ids[0]}", file=sys.stderr)
        if re.fullmatch(r"00-[0-9a-fA-F]{32}-[0-9a-fA-F]{16}-00", args.trace_id or ""):
            # The sampled flag is off: no hop recorded this request (trace_sample_ratio).
            print("(its traceparent says it was not sampled)", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"error: cannot reach the trace store at {base}: {exc.reason}", file=sys.stderr)
        return 1
    if args.json:
        documents = [fall.as_json() for fall in falls]
        print(json.dumps(documents[0] if args.trace_id or args.last else documents, indent=2))
    else:
        print("\n\n".join(render(fall) for fall in falls))
    return 0
