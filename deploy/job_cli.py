"""``meshserve job``: batch jobs from the command line, over the mesh's /v1/files and /v1/batches.

::

    meshserve job submit FILE [--model M] [--wait]   FILE: OpenAI batch JSONL, one KServe
                                                     v2 JSON request per line (--model), or
                                                     a folder of images (image_classifier)
    meshserve job status ID [--wait]                 counts and a progress bar
    meshserve job results ID [--errors] [-o FILE]    the result lines (JSONL)
    meshserve job cancel ID
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

DEFAULT_EDGE = "http://127.0.0.1:8080"
BAR = 30
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def _call(base: str, method: str, path: str, body: bytes | None = None, kind: str = "") -> bytes:
    request = urllib.request.Request(base.rstrip("/") + path, data=body, method=method)
    if kind:
        request.add_header("Content-Type", kind)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            data: bytes = response.read()
            return data
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            detail = json.loads(detail)["error"]["message"]
        raise SystemExit(f"error: {method} {path}: HTTP {exc.code}: {detail}") from exc
    except urllib.error.URLError as exc:
        raise SystemExit(f"error: cannot reach the mesh at {base}: {exc.reason}") from exc


def _json(base: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    answer: dict[str, Any] = json.loads(_call(base, method, path, data, "application/json"))
    return answer


def batch_lines(text: str, model: str | None) -> tuple[str, str]:
    """The file as OpenAI batch lines, and its endpoint (v2 requests are wrapped for ``model``)."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not rows:
        raise SystemExit("error: the file holds no requests")
    if all("custom_id" in row and "url" in row for row in rows):
        return text, rows[0]["url"]
    if not model:
        raise SystemExit("error: lines are KServe v2 requests: say which model with --model")
    url = f"/v2/models/{model}/infer"
    wrapped = [
        {"custom_id": f"line-{n}", "method": "POST", "url": url, "body": row}
        for n, row in enumerate(rows, start=1)
    ]
    return "".join(json.dumps(row) + "\n" for row in wrapped), url


def image_lines(folder: Path, model: str, input_name: str = "IMAGE") -> str:
    """One v2 request per image file in ``folder`` (custom_id: the file name), base64 in JSON."""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SystemExit(f"error: no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    rows = []
    for path in files:
        tensor = {
            "name": input_name,
            "datatype": "BYTES",
            "shape": [1, 1],
            "data": [base64.b64encode(path.read_bytes()).decode()],
            "parameters": {"content_encoding": "base64"},
        }
        url = f"/v2/models/{model}/infer"
        body = {"inputs": [tensor]}
        rows.append({"custom_id": path.name, "method": "POST", "url": url, "body": body})
    return "".join(json.dumps(row) + "\n" for row in rows)


def _upload(base: str, name: str, content: bytes) -> str:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n',
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n",
    ]
    body = parts[0].encode() + parts[1].encode() + content + f"\r\n--{boundary}--\r\n".encode()
    answer = json.loads(
        _call(base, "POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}")
    )
    file_id: str = answer["id"]
    return file_id


def progress(batch: dict[str, Any]) -> str:
    """One line: status, a bar and the counts."""
    counts = batch["request_counts"]
    total = max(1, counts["total"])
    done = counts["completed"] + counts["failed"]
    filled = BAR * done // total
    return (
        f"{batch['id']} {batch['status']:<11} [{'#' * filled}{'.' * (BAR - filled)}] "
        f"{done}/{counts['total']} ({counts['failed']} failed)"
    )


def _watch(base: str, batch_id: str, wait: bool) -> int:
    while True:
        batch = _json(base, "GET", f"/v1/batches/{batch_id}")
        line = progress(batch)
        if not wait or batch["status"] in ("completed", "failed", "cancelled", "expired"):
            print(("\r" if wait else "") + line, flush=True)
            return 0 if batch["status"] != "failed" else 1
        print("\r" + line, end="", flush=True, file=sys.stderr)
        time.sleep(1.0)


def submit(args: argparse.Namespace) -> int:
    """Upload a JSONL file and start a batch job over it."""
    if args.file.is_dir():
        model = args.model or "image_classifier"
        text, endpoint = image_lines(args.file, model, args.input), f"/v2/models/{model}/infer"
    else:
        text, endpoint = batch_lines(args.file.read_text(), args.model)
    file_id = _upload(args.url, args.file.name, text.encode())
    batch = _json(
        args.url,
        "POST",
        "/v1/batches",
        {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"},
    )
    print(batch["id"], flush=True)
    return _watch(args.url, batch["id"], True) if args.wait else 0


def status(args: argparse.Namespace) -> int:
    """A job's status and progress (--wait: until it ends)."""
    return _watch(args.url, args.id, args.wait)


def results(args: argparse.Namespace) -> int:
    """A finished job's result lines (or its error lines)."""
    batch = _json(args.url, "GET", f"/v1/batches/{args.id}")
    file_id = batch["error_file_id" if args.errors else "output_file_id"]
    if not file_id:
        print(f"{args.id}: {batch['status']}, no {'error' if args.errors else 'output'} file")
        return 1
    content = _call(args.url, "GET", f"/v1/files/{file_id}/content")
    if args.output:
        args.output.write_bytes(content)
    else:
        sys.stdout.buffer.write(content)
    return 0


def cancel(args: argparse.Namespace) -> int:
    """Cancel a job: lines not yet run are skipped."""
    print(progress(_json(args.url, "POST", f"/v1/batches/{args.id}/cancel")))
    return 0


def add_command(commands: Any) -> None:
    """``job`` and its subcommands on ``meshserve``'s command list."""
    job = commands.add_parser("job", help="batch jobs: submit, status, results, cancel")
    actions = job.add_subparsers(title="job commands", required=True, metavar="ACTION")
    for handler in (submit, status, results, cancel):
        summary = (handler.__doc__ or "").strip().splitlines()[0]
        parser = actions.add_parser(handler.__name__, help=summary, description=summary)
        parser.set_defaults(handler=handler)
        parser.add_argument(
            "--url", default=DEFAULT_EDGE, help="the mesh's edge (Envoy) (default: %(default)s)"
        )
        if handler is submit:
            parser.add_argument(
                "file", type=Path, help="JSONL (OpenAI batch lines or v2 requests) or image folder"
            )
            parser.add_argument(
                "--model", help="the model of v2 lines or images (images: image_classifier)"
            )
            parser.add_argument("--input", default="IMAGE", help="images: the model's input")
        else:
            parser.add_argument("id", help="the batch id")
        if handler in (submit, status):
            parser.add_argument("--wait", action="store_true", help="show progress until it ends")
        if handler is results:
            parser.add_argument("--errors", action="store_true", help="the error lines instead")
            parser.add_argument("-o", "--output", type=Path, help="write to this file")
