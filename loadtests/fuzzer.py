"""A seeded fuzzer of the mesh's front doors: v2 gRPC protobuf and REST / OpenAI JSON.

The path of one fuzz run, one line per piece::

    grpc_cases()   ModelInfer / ModelMetadata / ModelConfig / RepositoryIndex requests with
                   random names, shapes, datatypes, contents of wrong lengths, huge and
                   negative dims, random parameters; byte-flipped and raw random bodies
    http_cases()   JSON with random field types for /v2/models/{m}/infer, /v2/models/{m},
                   /v1/chat/completions and /api/v1/models/{m}/infer
    run_fuzz()     sends each case (a few at once) to Envoy or the orchestrator; an answer
                   that is 5xx, INTERNAL or UNKNOWN is a finding, unless ``KNOWN`` names
                   its class (a bug being fixed, with its issue item)

Imported by ``tests/integration/test_reliability.py`` (short run) and by
``loadtests/reliability.py`` (long run); it imports nothing from either.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import random
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from inference import grpc_service_pb2 as pb

V2 = "/inference.GRPCInferenceService/"
BAD_GRPC = frozenset({"INTERNAL", "UNKNOWN"})
"""gRPC codes that mean the server failed, not the caller."""
TIMEOUT_S = 15.0

KNOWN: dict[tuple[str, str], str] = {}
"""Finding classes that are known bugs being fixed: (case kind, outcome) -> issue item.
Each entry is removed when its fix lands; nothing else is excused."""

DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT64", "FP16", "FP32"]
DATATYPES += ["FP64", "BF16", "BYTES", "", "fp32", "FP8", "TYPE_FP32", "\x00", "INT128"]
DIMS = [-(2**63), -(2**31), -2, -1, 0, 1, 2, 3, 4, 8, 1000, 2**31, 2**40, 2**63 - 1]


@dataclass(frozen=True)
class Case:
    """One fuzz request: ``target`` is "edge" or "orchestrator"."""

    kind: str
    target: str
    method: str
    """A gRPC method name, or an HTTP method and path ("POST /v2/models/x/infer")."""
    body: bytes


@dataclass
class FuzzResult:
    """What a fuzz run saw: outcomes per case kind, and the findings."""

    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    findings: list[tuple[Case, str]] = field(default_factory=list)
    known: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, case: Case, outcome: str, detail: str) -> None:
        """Count one answer; keep it as a finding when the server failed."""
        with self.lock:
            self.cases += 1
            self.outcomes[outcome] += 1
            if not _server_failed(outcome):
                return
            item = KNOWN.get((case.kind, outcome))
            if item is not None:
                self.known[item] += 1
            else:
                self.findings.append((case, f"{outcome}: {detail[:300]}"))

    def bad_count(self) -> int:
        """Answers that were 5xx / INTERNAL / UNKNOWN, known or not."""
        return sum(n for outcome, n in self.outcomes.items() if _server_failed(outcome))


def _server_failed(outcome: str) -> bool:
    return outcome in BAD_GRPC or (outcome.isdigit() and int(outcome) >= 500)


def reproduction(case: Case) -> str:
    """A line that replays ``case`` (its body base64-encoded)."""
    return f"{case.target} {case.method} body_b64={base64.b64encode(case.body[:4096]).decode()}"


# -- random values ---------------------------------------------------------------


def junk_text(rng: random.Random) -> str:
    """A random string: empty, short, unicode, control characters, path-like or huge."""
    makers: list[Callable[[], str]] = [
        lambda: "",
        lambda: "".join(rng.choice("abcXYZ_-./09") for _ in range(rng.randrange(1, 20))),
        lambda: "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(1, 12))),
        lambda: "".join(chr(rng.randrange(0, 32)) for _ in range(rng.randrange(1, 8))),
        lambda: rng.choice(["../../etc/passwd", "%00", "${jndi:x}", "' OR 1=1", "\\u0000"]),
        lambda: rng.choice("ab") * rng.choice([256, 4096, 70_000]),
        lambda: rng.choice(["add_sub", "mean_pool", "INPUT0", "OUTPUT0", "1", "-1"]),
    ]
    return rng.choice(makers)()


def junk_json(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value of any type, nested at most three deep."""
    makers: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.choice([0, -1, 1, 2**31, -(2**63), 2**64, 10**30, rng.randrange(-100, 100)]),
        lambda: rng.choice([0.5, -1e308, 1e308, 3.14, -0.0]),
        lambda: junk_text(rng),
    ]
    if depth < 3:
        makers += [
            lambda: [junk_json(rng, depth + 1) for _ in range(rng.randrange(0, 5))],
            lambda: {
                junk_text(rng)[:20]: junk_json(rng, depth + 1) for _ in range(rng.randrange(0, 4))
            },
        ]
    return rng.choice(makers)()


def model_name(rng: random.Random) -> str:
    """A served model's name half the time (so requests reach a stage), else junk."""
    return "add_sub" if rng.random() < 0.5 else junk_text(rng)


# -- gRPC cases ----------------------------------------------------------------


def _parameters(rng: random.Random, target: Any) -> None:
    for _ in range(rng.choice([0, 0, 1, 3])):
        param = target[junk_text(rng)[:64]]
        kind = rng.randrange(5)
        if kind == 0:
            param.bool_param = rng.random() < 0.5
        elif kind == 1:
            param.int64_param = rng.choice([-(2**63), -1, 0, 1, 2**63 - 1])
        elif kind == 2:
            param.string_param = junk_text(rng)[:1000]
        elif kind == 3:
            param.double_param = rng.choice([float("nan"), float("inf"), -1.5, 1e300])
        else:
            param.uint64_param = rng.choice([0, 1, 2**64 - 1])


def _tensor(rng: random.Random, request: pb.ModelInferRequest) -> None:
    tensor = request.inputs.add()
    tensor.name = rng.choice(["INPUT0", "INPUT1", "INPUT0", junk_text(rng)[:100]])
    tensor.datatype = rng.choice(["FP32", "FP32", *DATATYPES])
    tensor.shape.extend(rng.choice([[1, 4], [4], [], [rng.choice(DIMS) for _ in range(3)]]))
    _parameters(rng, tensor.parameters)
    style = rng.randrange(4)
    if style == 0:  # the right length for a [1, 4] FP32 tensor
        request.raw_input_contents.append(rng.randbytes(16))
    elif style == 1:  # a wrong length
        request.raw_input_contents.append(rng.randbytes(rng.choice([0, 1, 3, 15, 17, 4096])))
    elif style == 2:  # typed contents, maybe of the wrong type or count
        contents = tensor.contents
        count = rng.choice([0, 1, 4, 5])
        if rng.random() < 0.5:
            contents.fp32_contents.extend([1.0] * count)
        else:
            contents.int_contents.extend([1] * count)
        if rng.random() < 0.3:
            contents.bytes_contents.append(rng.randbytes(rng.randrange(0, 64)))
    # style 3: no contents at all


def infer_request(rng: random.Random) -> pb.ModelInferRequest:
    """A ModelInferRequest: mostly add_sub-shaped, every field possibly wrong."""
    request = pb.ModelInferRequest(model_name=model_name(rng))
    request.model_version = rng.choice(["", "", "1", "0", "-1", "99999999999", junk_text(rng)])
    request.id = rng.choice(["", junk_text(rng)[:200]])
    _parameters(rng, request.parameters)
    for _ in range(rng.choice([0, 1, 2, 2, 2, 3])):
        _tensor(rng, request)
    for _ in range(rng.choice([0, 0, 1, 2])):
        output = request.outputs.add(name=rng.choice(["OUTPUT0", junk_text(rng)[:100]]))
        _parameters(rng, output.parameters)
    if rng.random() < 0.1:  # raw contents without matching inputs
        request.raw_input_contents.append(rng.randbytes(rng.randrange(0, 100)))
    return request


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """``data`` with a few bytes flipped, cut short or extended."""
    buffer = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        if buffer and rng.random() < 0.7:
            buffer[rng.randrange(len(buffer))] = rng.randrange(256)
        elif buffer:
            del buffer[rng.randrange(len(buffer)) :]
        else:
            buffer += rng.randbytes(8)
    return bytes(buffer)


def grpc_case(rng: random.Random, target: str) -> Case:
    """One random gRPC request for ``target``."""
    roll = rng.random()
    if roll < 0.45:
        return Case("grpc:infer", target, "ModelInfer", infer_request(rng).SerializeToString())
    if roll < 0.55:
        body = pb.ModelMetadataRequest(name=model_name(rng), version=junk_text(rng)[:50])
        return Case("grpc:metadata", target, "ModelMetadata", body.SerializeToString())
    if roll < 0.65:
        config = pb.ModelConfigRequest(name=model_name(rng), version=junk_text(rng)[:50])
        return Case("grpc:config", target, "ModelConfig", config.SerializeToString())
    if roll < 0.7:
        index = pb.RepositoryIndexRequest(
            repository_name=junk_text(rng)[:100], ready=rng.random() < 0.5
        )
        return Case("grpc:index", target, "RepositoryIndex", index.SerializeToString())
    method = rng.choice(["ModelInfer", "ModelInfer", "ModelMetadata", "ModelConfig"])
    if roll < 0.85:  # a valid request with bytes flipped: often undecodable
        mutated = _mutate(rng, infer_request(rng).SerializeToString())
        return Case("grpc:mutated", target, method, mutated)
    return Case("grpc:raw-bytes", target, method, rng.randbytes(rng.randrange(1, 200)))


def grpc_cases(seed: int, count: int, targets: Sequence[str]) -> Iterator[Case]:
    """``count`` gRPC cases from ``seed``, spread over ``targets``."""
    rng = random.Random(seed)
    for i in range(count):
        yield grpc_case(rng, targets[i % len(targets)])


# -- HTTP cases ----------------------------------------------------------------


def _v2_infer_body(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return junk_json(rng)
    tensor: dict[str, Any] = {
        "name": rng.choice(["INPUT0", "INPUT1", junk_json(rng)]),
        "shape": rng.choice([[1, 4], [4], junk_json(rng), [rng.choice(DIMS)] * 2]),
        "datatype": rng.choice(["FP32", *DATATYPES, junk_json(rng)]),
        "data": rng.choice([[1.0, 2.0, 3.0, 4.0], [[1, 2, 3, 4]], junk_json(rng), [], ["a"]]),
    }
    if rng.random() < 0.2:
        tensor["parameters"] = junk_json(rng)
    body: dict[str, Any] = {"inputs": rng.choice([[tensor, dict(tensor, name="INPUT1")], [tensor]])}
    if rng.random() < 0.3:
        body[rng.choice(["outputs", "parameters", "id", junk_text(rng)[:20]])] = junk_json(rng)
    return body


def _chat_body(rng: random.Random) -> Any:
    body: dict[str, Any] = {
        "model": rng.choice(["add_sub", "llm", junk_json(rng)]),
        "messages": rng.choice(
            [[{"role": "user", "content": "hi"}], junk_json(rng), [{"role": junk_json(rng)}]]
        ),
    }
    for key in ("max_tokens", "temperature", "stream", "n", "stop", "top_p", "logprobs"):
        if rng.random() < 0.25:
            body[key] = junk_json(rng)
    return body


def http_case(rng: random.Random) -> Case:
    """One random request to a REST route through Envoy."""
    model = model_name(rng)[:300]
    quoted = urllib.parse.quote(model, safe="") or "x"
    query = f"?{urllib.parse.quote(junk_text(rng)[:20])}=a" if rng.random() < 0.1 else ""
    roll = rng.random()
    if roll < 0.4:
        route, body = f"POST /v2/models/{quoted}/infer", _v2_infer_body(rng)
        kind = "http:v2-infer"
    elif roll < 0.5:
        route, body, kind = f"GET /v2/models/{quoted}", None, "http:v2-metadata"
    elif roll < 0.8:
        route, body, kind = "POST /v1/chat/completions", _chat_body(rng), "http:chat"
    else:
        route, body = f"POST /api/v1/models/{quoted}/infer", _v2_infer_body(rng)
        kind = "http:api-v1-infer"
    data = b"" if body is None else json.dumps(body).encode()
    if data and rng.random() < 0.1:  # JSON cut short: not JSON at all
        data = data[: rng.randrange(len(data))]
    return Case(kind + ("+query" if query else ""), "edge", route + query, data)


def http_cases(seed: int, count: int) -> Iterator[Case]:
    """``count`` HTTP cases from ``seed``."""
    rng = random.Random(seed)
    for _ in range(count):
        yield http_case(rng)


# -- sending -------------------------------------------------------------------


def send_grpc(channel: grpc.Channel, case: Case) -> tuple[str, str]:
    """Send the case's bytes as they are; its outcome (a status code name) and detail."""
    call = channel.unary_unary(V2 + case.method)  # no serializer: the bytes go as they are
    try:
        call(case.body, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code().name, str(exc.details())
    return "OK", ""


def send_http(base_url: str, case: Case) -> tuple[str, str]:
    """Send the case over HTTP; its outcome (the status as digits) and body's start."""
    verb, path = case.method.split(" ", 1)
    request = urllib.request.Request(
        base_url + path,
        data=case.body if verb == "POST" else None,
        headers={"Content-Type": "application/json"},
        method=verb,
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return str(response.status), ""
    except urllib.error.HTTPError as err:
        return str(err.code), err.read(300).decode(errors="replace")
    except TimeoutError:  # a valid but long request (an LLM chat without max_tokens)
        return "timeout", ""
    except (OSError, urllib.error.URLError) as err:  # a reset connection is the server's fault
        return "599", f"connection: {err}"


def run_fuzz(cases: Sequence[Case], addresses: dict[str, str], workers: int = 4) -> FuzzResult:
    """Send every case (``workers`` at once); ``addresses`` maps a target to host:port."""
    result = FuzzResult()
    channels = {name: grpc.insecure_channel(address) for name, address in addresses.items()}
    base_url = f"http://{addresses['edge']}"

    def send(case: Case) -> None:
        if case.kind.startswith("grpc:"):
            outcome, detail = send_grpc(channels[case.target], case)
        else:
            outcome, detail = send_http(base_url, case)
        result.add(case, outcome, detail)

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(send, case) for case in cases]:
                future.result()
    finally:
        for channel in channels.values():
            channel.close()
    return result
