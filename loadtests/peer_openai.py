"""The mesh's OpenAI API against vLLM's own server, field by field, on the same model.

    python loadtests/peer_openai.py [--repository DIR] [--mesh-url URL]
    python loadtests/peer_openai.py --only mesh|vllm --out FILE   # one engine at a time
    python loadtests/peer_openai.py --compare MESH.json VLLM.json

Starts the mesh (``deploy.local.supervisor --ports auto``) and ``python -m
vllm.entrypoints.openai.api_server`` on the same model folder with the same
engine settings (bench_llm.vllm_server), then sends both the same requests
with the openai SDK (tests/clients/openai_parity.py: n with a seed, logprobs,
structured output, tools) and raw HTTP (the SSE framing, error bodies), and
prints every difference:

- shapes: the key paths of each answer document and chunk, on one side only;
- logprobs: the greedy chat with top_logprobs=5, token by token, the largest
  difference of any logprob (the issue's bound: 1e-4);
- errors: the HTTP status, error type and param of each refused request;
- framing: the lines of a streamed answer (``data: `` events, ``[DONE]``).

Without ``--only`` both servers run at once (two engines: about 9 GB); with
it, one side at a time, compared afterwards. Everything started is stopped by
PID on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench_llm import ENGINE_MODEL, MESH_MODEL, vllm_server
from common import DEFAULT_REPOSITORY, install_sigterm_exit, running_mesh

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "tests" / "clients" / "openai_parity.py"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BAD_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "negative max_tokens": ("chat/completions", {"messages": QUESTION, "max_tokens": -1}),
    "temperature string": ("completions", {"prompt": "Hi", "temperature": "warm"}),
    "top_logprobs 30": (
        "chat/completions",
        {"messages": QUESTION, "logprobs": True, "top_logprobs": 30},
    ),
    "tools, no parser": (
        "chat/completions",
        {
            "messages": QUESTION,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
        },
    ),
    "unknown model": ("chat/completions", {"model": "ghost", "messages": QUESTION}),
    "greedy n=2": ("chat/completions", {"messages": QUESTION, "n": 2, "temperature": 0}),
    "response_format xml": (
        "chat/completions",
        {"messages": QUESTION, "response_format": {"type": "xml"}},
    ),
}


def paths(document: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON document (list items share ``[]``)."""
    found = {prefix} if prefix else set()
    if isinstance(document, dict):
        for key, value in document.items():
            found |= paths(value, f"{prefix}.{key}")
    elif isinstance(document, list):
        for item in document:
            found |= paths(item, f"{prefix}[]")
    return found


def parity(base_url: str, model: str) -> dict[str, Any]:
    """tests/clients/openai_parity.py's answers from one server."""
    command = [sys.executable, str(CLIENT), json.dumps(base_url), json.dumps(model)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
    answers: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST ``body``; the status and the raw answer."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def errors(base_url: str, model: str) -> dict[str, tuple[int, str, str]]:
    """Each bad body's status, error type and param."""
    seen = {}
    for name, (path, body) in BAD_BODIES.items():
        status, raw = post(f"{base_url}/{path}", {"model": model, **body})
        try:
            error = json.loads(raw).get("error", {})
        except ValueError:
            error = {"type": raw[:60].decode(errors="replace")}
        seen[name] = (status, str(error.get("type")), str(error.get("param")))
    return seen


def framing(base_url: str, model: str) -> list[str]:
    """A streamed chat's SSE lines, each reduced to its kind."""
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, "temperature": 1, "seed": 1}
    status, raw = post(f"{base_url}/chat/completions", {**body, "stream": True, "n": 2})
    kinds = [f"HTTP {status}"]
    for line in raw.decode().split("\n"):
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            kinds.append(f"data: chunk index={choices[0].get('index')}")
        else:
            kinds.append(line or "(blank)")
    return kinds


def logprob_gap(mesh: dict[str, Any], vllm: dict[str, Any]) -> tuple[float, list[str]]:
    """The largest |mesh - vLLM| over the greedy chat's logprobs, and any token mismatch."""
    ours = mesh["logprobs"]["chat"]["choices"][0]["logprobs"]["content"]
    theirs = vllm["logprobs"]["chat"]["choices"][0]["logprobs"]["content"]
    gap, problems = 0.0, []
    if len(ours) != len(theirs):
        problems.append(f"{len(ours)} tokens vs {len(theirs)}")
    for a, b in zip(ours, theirs, strict=False):
        if a["token"] != b["token"]:
            problems.append(f"token {a['token']!r} vs {b['token']!r}")
            continue
        gap = max(gap, abs(a["logprob"] - b["logprob"]))
        tops_a = {t["token"]: t["logprob"] for t in a["top_logprobs"]}
        tops_b = {t["token"]: t["logprob"] for t in b["top_logprobs"]}
        if set(tops_a) != set(tops_b):
            problems.append(f"top tokens {sorted(tops_a)} vs {sorted(tops_b)}")
            continue
        gap = max(gap, *(abs(tops_a[t] - tops_b[t]) for t in tops_a))
    return gap, problems


def shape_differences(mesh: dict[str, Any], vllm: dict[str, Any]) -> Iterator[str]:
    """Key paths present on one side only, per document kind."""
    documents = {
        "chat (logprobs)": lambda d: d["logprobs"]["chat"],
        "completion (logprobs)": lambda d: d["logprobs"]["completion"],
        "chat chunk (logprobs)": lambda d: d["logprobs"]["chat_chunks"],
    }
    for name, pick in documents.items():
        ours, theirs = paths(pick(mesh)), paths(pick(vllm))
        for path in sorted(ours - theirs):
            yield f"{name}: only the mesh has {path}"
        for path in sorted(theirs - ours):
            yield f"{name}: only vLLM has {path}"


def collect(base_url: str, model: str) -> dict[str, Any]:
    """Everything compared, from one server."""
    return {
        "answers": parity(base_url, model),
        "errors": errors(base_url, model),
        "framing": framing(base_url, model),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--mesh-url", help="a running mesh's /v1 URL (else one is started)")
    parser.add_argument(
        "--only",
        choices=["mesh", "vllm"],
        help="collect one side into --out (one engine at a time; compare with --compare)",
    )
    parser.add_argument("--out", type=Path, help="where --only writes its side (JSON)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("MESH", "VLLM"))
    args = parser.parse_args(argv)
    args.repository = args.repository.expanduser()
    install_sigterm_exit()
    if args.compare:
        sides = [json.loads(path.read_text()) for path in args.compare]
        report(dict(zip(("mesh", "vllm"), sides, strict=True)))
        return 0
    seen: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        if args.only != "vllm":
            url = args.mesh_url
            if url is None:
                print("starting the mesh ...", flush=True)
                info = stack.enter_context(running_mesh(args.repository, ready_timeout_s=1500))
                url = f"http://{info.edge}/v1"
            seen["mesh"] = collect(url, MESH_MODEL)
        if args.only != "mesh":
            print("starting vLLM's server ...", flush=True)
            seen["vllm"] = collect(stack.enter_context(vllm_server(args.repository)), ENGINE_MODEL)
    if args.only:
        args.out.write_text(json.dumps(seen[args.only]))
        return 0
    report(seen)
    return 0


def report(seen: dict[str, dict[str, Any]]) -> None:
    """Print every comparison."""
    answers = {side: seen[side]["answers"] for side in ("mesh", "vllm")}
    mesh, vllm = answers["mesh"], answers["vllm"]
    gap, problems = logprob_gap(mesh, vllm)
    print(f"greedy chat, top_logprobs=5: largest logprob difference {gap:.2e} (bound 1e-4)")
    for problem in problems:
        print(f"  mismatch: {problem}")
    for side, answer in answers.items():
        first, again = answer["seeded"]
        print(f"{side}: n=3 seed=1234: {len(set(first))} distinct, repeat equal: {first == again}")
        print(f"  {first}")
        valid = sum(_valid(a, answer["schema"]) for a in answer["schema_answers"])
        print(f"  json_schema answers valid: {valid}/20; extras {answer['extras']}")
        print(f"  tools: {answer['tools']['whole']}")
    print("n=3 seed=1234 choices equal across servers:", mesh["seeded"][0] == vllm["seeded"][0])
    print("shape differences:")
    for line in shape_differences(mesh, vllm):
        print(f"  {line}")
    print("errors (status, type, param):")
    for name in BAD_BODIES:
        a, b = (seen[side]["errors"][name] for side in ("mesh", "vllm"))
        print(f"  {'same' if a == b else 'DIFF'} {name}: mesh {a} | vLLM {b}")
    print("streaming framing (n=2, 4 tokens):")
    for side in ("mesh", "vllm"):
        print(f"  {side}: {seen[side]['framing']}")


def _valid(answer: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(answer), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
