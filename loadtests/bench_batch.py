"""Batch jobs at full size: what tests/integration/test_batch_jobs.py runs small.

    python loadtests/bench_batch.py embeddings [--lines 500]
    python loadtests/bench_batch.py restart    [--lines 200]
    python loadtests/bench_batch.py priority   [--images 1000] [--seconds 20] [--no-priority]
                                               [--workers 2] [--concurrency 4]
    python loadtests/bench_batch.py chat       [--lines 200] [--max-tokens 16]
    python loadtests/bench_batch.py run-batch  [--prompts 256] [--max-tokens 64]

Each mode starts its own local mesh (``deploy.local.supervisor --ports auto``,
Redis and the batch workers in a temporary jobs folder) on the prepared
repository, and stops it (by PID) at the end:

- ``embeddings``: an N-line /v1/embeddings batch through the openai SDK; every
  line's vector against the same request sent online.
- ``restart``: a job of the ``slow`` test model; the whole mesh (Redis too) is
  stopped and started again mid-job; each line must have exactly one result.
- ``priority``: online ``image_classifier`` latency at 4 in flight, without and
  then with a job of N images running (the models' configs get two priority
  levels; ``--no-priority`` sends the job at the online level). Prints p50/p99
  of both and their ratio.
- ``chat``: an N-line greedy chat batch through the openai SDK against the same
  requests sent online (texts must be equal).
- ``run-batch``: N prompts x M tokens through the job API vs vLLM's own
  ``python -m vllm.entrypoints.openai.run_batch`` on the same engine settings;
  run_batch's time is its own progress bar's (whole seconds, the engine's start
  left out); the job API's is upload to results, as a client sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from common import (
    DEFAULT_REPOSITORY,
    ROOT,
    MeshInfo,
    _stop_mesh,
    _wait_ready,
    install_sigterm_exit,
    machine_cpu_seconds,
    start_supervisor,
)

from deploy.local.procfs import descendants, process_cpu_seconds

IMAGE_MODELS = ("image_classifier", "image_preprocess", "mobilenet_v2_onnx", "imagenet_top5")
TEXT_MODELS = ("text_embedding", "minilm", "minilm_tokenizer", "mean_pool")
LLM_MODELS = ("llm", "smollm2", "smollm2_tokenizer", "smollm2_detokenizer")
PRIORITY_LEVELS = "  priority_levels: 2\n  default_priority_level: 1\n"
SKIMAGE = Path(np.__file__).resolve().parent.parent / "skimage" / "data"


def repository(folder: Path, prepared: Path, names: Sequence[str], levels: bool) -> Path:
    """Links to the prepared models; with ``levels``, configs with two priority levels
    (for models prepared without them; the default pipelines declare them)."""
    folder.mkdir(parents=True)
    for name in names:
        source = (prepared / name).resolve()
        written = source / "config.pbtxt"
        config = written.read_text() if written.exists() else ""
        if not levels or name == "image_classifier" or "priority_levels" in config:
            (folder / name).symlink_to(source, target_is_directory=True)
            continue
        (folder / name).mkdir()
        for item in source.iterdir():
            if item.name != "config.pbtxt":
                (folder / name / item.name).symlink_to(item)
        if "dynamic_batching {" in config:
            config = config.replace(
                "dynamic_batching {\n", "dynamic_batching {\n" + PRIORITY_LEVELS
            )
        else:
            config += "\ndynamic_batching {\n" + PRIORITY_LEVELS + "}\n"
        (folder / name / "config.pbtxt").write_text(config)
    return folder


def mesh_yaml(folder: Path, batch: dict[str, Any], workers: int = 2) -> Path:
    document = yaml.safe_load((ROOT / "deploy" / "local" / "mesh.yaml").read_text())
    document["services"]["batch"] = {**document["services"].get("batch", {}), **batch}
    document["supervisor"]["jobs"] = {"enabled": True, "workers": workers, "dir": str(folder)}
    path = folder / "mesh.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@contextlib.contextmanager
def mesh(repo: Path, config: Path, log: Path) -> Iterator[MeshInfo]:
    # A busy shared host may take minutes to start the LLM's engine.
    proc = start_supervisor(repo, config, log, 900.0)
    try:
        yield _wait_ready(proc, 900.0, log)
    finally:
        _stop_mesh(proc, {})


def client(info: MeshInfo) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"http://{info.edge}/v1", api_key="unused", max_retries=3)


def run_job(info: MeshInfo, lines: Sequence[dict[str, Any]], endpoint: str) -> tuple[Any, float]:
    """Submit, wait for the end (progress on stderr); the batch and its seconds."""
    sdk = client(info)
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    began = time.monotonic()
    upload = sdk.files.create(file=("input.jsonl", text), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    return wait(info, batch.id), time.monotonic() - began


def wait(info: MeshInfo, batch_id: str) -> Any:
    sdk = client(info)
    while True:
        batch = sdk.batches.retrieve(batch_id)
        counts = batch.request_counts
        print(f"\r  {batch.status:<11} {counts.completed}/{counts.total}", end="", file=sys.stderr)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            print(file=sys.stderr)
            return batch
        time.sleep(0.5)


def outputs(info: MeshInfo, batch: Any) -> dict[str, Any]:
    text = client(info).files.content(batch.output_file_id).text
    rows = [json.loads(row) for row in text.splitlines() if row.strip()]
    found = {row["custom_id"]: row for row in rows}
    assert len(found) == len(rows), "a custom_id has two result lines"
    return found


# -- modes ---------------------------------------------------------------------


def embeddings(args: argparse.Namespace, work: Path) -> None:
    repo = repository(work / "repo", args.repository, TEXT_MODELS, False)
    with mesh(repo, mesh_yaml(work, {}), work / "mesh.log") as info:
        texts = [f"line {i}: a sentence about {('cats', 'ships', 'rain', 'jazz')[i % 4]}"
                 for i in range(args.lines)]  # fmt: skip
        lines = [
            {"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "text_embedding", "input": text}}
            for i, text in enumerate(texts)
        ]  # fmt: skip
        batch, seconds = run_job(info, lines, "/v1/embeddings")
        rows = outputs(info, batch)
        worst = 0.0
        for i, text in enumerate(texts):
            online = client(info).embeddings.create(model="text_embedding", input=text)
            offline = rows[f"e-{i}"]["response"]["body"]["data"][0]["embedding"]
            worst = max(
                worst, float(np.max(np.abs(np.subtract(offline, online.data[0].embedding))))
            )
        print(f"embeddings batch: {len(rows)}/{args.lines} lines answered once each, "
              f"{batch.request_counts.failed} failed, {seconds:.1f} s "
              f"({len(rows) / seconds:.0f} lines/s); "
              f"largest difference to the online answer: {worst:.2e}")  # fmt: skip


def restart(args: argparse.Namespace, work: Path) -> None:
    repo = work / "repo"
    repo.mkdir()
    shutil.copytree(ROOT / "tests" / "data" / "models" / "slow", repo / "slow")
    config = mesh_yaml(work, {"claim_idle_s": 5})
    body = {"inputs": [{"name": "MS", "datatype": "INT32", "shape": [1], "data": [50]}]}
    lines = [{"custom_id": f"s-{i}", "method": "POST", "url": "/v2/models/slow/infer", "body": body}
             for i in range(args.lines)]  # fmt: skip
    with mesh(repo, config, work / "mesh.log") as info:
        sdk = client(info)
        text = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = sdk.files.create(file=("input.jsonl", text), purpose="batch")
        batch_id = sdk.batches.create(
            input_file_id=upload.id, endpoint="/v2/models/slow/infer", completion_window="24h"
        ).id
        while (done := sdk.batches.retrieve(batch_id).request_counts.completed) < args.lines // 4:
            time.sleep(0.1)
        print(f"stopping the whole mesh with {done}/{args.lines} lines done")
    with mesh(repo, config, work / "mesh2.log") as info:
        batch = wait(info, batch_id)
        rows = outputs(info, batch)
        ok = set(rows) == {line["custom_id"] for line in lines}
        print(f"after the restart: {batch.status}, {len(rows)} result lines for {args.lines} "
              f"input lines, each custom_id once: {ok}")  # fmt: skip


def image_folder(folder: Path, count: int) -> Path:
    """``count`` small JPEGs cut from scikit-image's sample photos (or noise without them)."""
    from PIL import Image

    folder.mkdir()
    photos = [Image.open(p).convert("RGB") for p in sorted(SKIMAGE.glob("*.png"))[:8]]
    rng = np.random.default_rng(0)
    for i in range(count):
        if photos:
            photo = photos[i % len(photos)]
            side = min(photo.size)
            x, y = (int(rng.integers(0, 1 + d - side // 2)) for d in photo.size)
            image = photo.crop((x, y, x + side // 2, y + side // 2)).resize((256, 256))
        else:
            image = Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8))
        image.save(folder / f"img-{i:05d}.jpg", quality=85)
    return folder


async def online_latencies(orchestrator: str, image: bytes, seconds: float) -> list[float]:
    """ModelInfer image_classifier with 4 in flight for ``seconds``; each call's latency."""
    import grpc

    from inference import grpc_service_pb2 as pb
    from inference import grpc_service_pb2_grpc as pb_grpc
    from shared.tensors import serialize_bytes

    request = pb.ModelInferRequest(model_name="image_classifier")
    request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1, 1])
    array = np.empty(1, dtype=object)
    array[0] = image
    request.raw_input_contents.append(serialize_bytes(array))
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(orchestrator) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        end = time.monotonic() + seconds

        async def loop() -> None:
            while time.monotonic() < end:
                began = time.perf_counter()
                await stub.ModelInfer(request, timeout=60)
                latencies.append(time.perf_counter() - began)

        await asyncio.gather(*(loop() for _ in range(4)))
    return latencies


def _ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000)


def priority(args: argparse.Namespace, work: Path) -> None:
    from deploy.job_cli import image_lines

    repo = repository(work / "repo", args.repository, IMAGE_MODELS, True)
    images = image_folder(work / "images", args.images)
    lines = [json.loads(row) for row in image_lines(images, "image_classifier").splitlines()]
    probe = (images / "img-00000.jpg").read_bytes()
    batch_settings = {"priority": 0 if args.no_priority else 2, "concurrency": args.concurrency}
    config = mesh_yaml(work, batch_settings, args.workers)
    with mesh(repo, config, work / "mesh.log") as info:
        asyncio.run(online_latencies(info.orchestrator, probe, 3))  # warm up
        alone = asyncio.run(online_latencies(info.orchestrator, probe, args.seconds))
        sdk = client(info)
        text = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = sdk.files.create(file=("images.jsonl", text), purpose="batch")
        batch_id = sdk.batches.create(
            input_file_id=upload.id, endpoint="/v2/models/image_classifier/infer",
            completion_window="24h",
        ).id  # fmt: skip
        while sdk.batches.retrieve(batch_id).request_counts.completed < 8:
            time.sleep(0.2)
        before = sdk.batches.retrieve(batch_id).request_counts.completed
        beside = asyncio.run(online_latencies(info.orchestrator, probe, args.seconds))
        after = sdk.batches.retrieve(batch_id).request_counts
        sdk.batches.cancel(batch_id)
    level = "the online level" if args.no_priority else "priority level 2 of 2"
    print(f"online image_classifier, 4 in flight, {args.seconds:.0f} s each; the job at {level},"
          f" {args.workers} worker(s) x {args.concurrency} lines in flight")  # fmt: skip
    for label, values in (("without the job", alone), ("with the job", beside)):
        print(f"  {label:<16} {len(values):>5} calls  p50 {_ms(values, 50):7.1f} ms  "
              f"p99 {_ms(values, 99):7.1f} ms")  # fmt: skip
    print(f"  p99 ratio (with / without): {_ms(beside, 99) / _ms(alone, 99):.2f}x; the job ran "
          f"{(after.completed - before) / args.seconds:.1f} images/s meanwhile "
          f"({after.failed} failed)")  # fmt: skip


def chat_lines(count: int, max_tokens: int, model: str) -> list[dict[str, Any]]:
    topics = ("the sea", "a cat", "rain", "mountains", "jazz", "bread", "winter", "trains")
    return [
        {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                  "messages": [{"role": "user",
                                "content": f"Write sentence {i} about {topics[i % 8]}."}]}}
        for i in range(count)
    ]  # fmt: skip


def chat(args: argparse.Namespace, work: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    repo = repository(work / "repo", args.repository, LLM_MODELS, False)
    lines = chat_lines(args.lines, args.max_tokens, "llm")
    with mesh(repo, mesh_yaml(work, {"concurrency": 16}), work / "mesh.log") as info:
        batch, seconds = run_job(info, lines, "/v1/chat/completions")
        rows = outputs(info, batch)
        sdk = client(info)

        def online(line: dict[str, Any]) -> str:
            answer = sdk.chat.completions.create(**line["body"])
            return str(answer.choices[0].message.content)

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(online, lines))
    same = sum(
        rows[line["custom_id"]]["response"]["body"]["choices"][0]["message"]["content"] == text
        for line, text in zip(lines, texts, strict=True)
    )
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows.values())
    print(f"chat batch: {len(rows)}/{args.lines} lines answered once each "
          f"({batch.request_counts.failed} failed) in {seconds:.1f} s, "
          f"{tokens / seconds:.0f} tok/s; "
          f"{same}/{args.lines} texts equal to the same request sent online (greedy)")  # fmt: skip


def run_batch_seconds(
    flags: list[str], lines: list[dict[str, Any]], work: Path
) -> tuple[float, int, dict[str, str]]:
    """vLLM's run_batch over ``lines``: wall seconds, completion tokens, texts by custom_id."""
    source, target = work / "in.jsonl", work / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    target.unlink(missing_ok=True)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch"]
    command += ["-i", str(source), "-o", str(target), *flags]
    env = {**__import__("os").environ, "VLLM_RPC_BASE_PATH": str(work), "TMPDIR": str(work)}
    machine = machine_cpu_seconds()
    began, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with (work / "run_batch.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env,
                       timeout=3600)  # fmt: skip
    seconds = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    busy = (machine_cpu_seconds() - machine) / max(1.0, seconds)
    print(f"vLLM run_batch: {cpu_s:.1f} CPU seconds in all (its engine's start included);"
          f" the machine kept {busy:.1f} cores busy on average meanwhile")  # fmt: skip
    # Its progress bar's elapsed time: the batch alone, without the engine's start.
    log_text = (work / "run_batch.log").read_text()
    bars = re.findall(r"Running batch: 100%.*?\[(\d+):(\d+)", log_text)
    if bars:
        seconds = int(bars[-1][0]) * 60 + int(bars[-1][1])
    rows = [json.loads(row) for row in target.read_text().splitlines() if row.strip()]
    tokens = sum(
        (row.get("response") or {}).get("body", {}).get("usage", {}).get("completion_tokens", 0)
        for row in rows
    )
    texts = {row["custom_id"]: _content((row.get("response") or {}).get("body")) for row in rows}
    return seconds, tokens, texts


def _content(body: Any) -> str:
    return str(body["choices"][0]["message"]["content"]) if body else ""


class Occupancy:
    """The engine's running and waiting requests, read from the inference service's
    /metrics every half second in a thread while a job runs (their means)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Occupancy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        import urllib.request

        while not self._stop.wait(0.5):
            with contextlib.suppress(OSError):
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
                values = dict.fromkeys(("running", "waiting"), 0.0)
                for name in values:
                    found = re.search(rf"^meshserve_llm_requests_{name}\{{.*?}} (\S+)$", text, re.M)
                    values[name] = float(found[1]) if found else 0.0
                self.samples.append((values["running"], values["waiting"]))

    def means(self) -> tuple[float, float]:
        """Mean running and waiting requests over the samples taken while busy."""
        busy = [s for s in self.samples if s[0] > 0] or [(0.0, 0.0)]
        return float(np.mean([s[0] for s in busy])), float(np.mean([s[1] for s in busy]))


def tree_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds by service, its descendants (an engine's processes) included."""
    return {
        name: sum(process_cpu_seconds(pid) for pid in descendants(root))
        for name, root in pids.items()
        if name != "envoy_wrapper"
    }


def uncapped(model: Path) -> None:
    """The engine's config without max_generation_s, as run_batch has none: on a busy
    host a 64-token line among 16 may take minutes, and a cap would cut it."""
    from models.smollm2 import MODEL_CONFIG

    written = model / "config.pbtxt"  # the code's own, where a rebuild left none
    config = written.read_text() if written.exists() else MODEL_CONFIG
    config = re.sub(
        r'(key: "max_generation_s"\s*value: \{ string_value: )"[^"]*"', r'\1"0"', config
    )
    source = model.resolve()
    model.unlink()
    model.mkdir()
    for item in source.iterdir():
        if item.name != "config.pbtxt":
            (model / item.name).symlink_to(item)
    (model / "config.pbtxt").write_text(config)


def scheduling_policy(repo: Path) -> str:
    """The engine's scheduling_policy in the repository's LLM config."""
    from bench_llm import engine_spec

    from services.inference.vllm_settings import EngineSettings

    return EngineSettings.from_spec(engine_spec(repo)).scheduling_policy


def run_batch(args: argparse.Namespace, work: Path) -> None:
    from bench_llm import ENGINE_MODEL, engine_flags

    repo = repository(work / "repo", args.repository, LLM_MODELS, False)
    uncapped(repo / "smollm2")
    lines = chat_lines(args.prompts, args.max_tokens, "llm")
    settings = {"concurrency": args.concurrency}
    with mesh(repo, mesh_yaml(work, settings, workers=1), work / "mesh.log") as info:
        before, machine = tree_cpu(info.pids), machine_cpu_seconds()
        engine = next(port for name, port in info.metrics_ports.items() if "inference" in name)
        with Occupancy(engine) as occupancy:
            batch, mesh_s = run_job(info, lines, "/v1/chat/completions")
        used = {k: v - before.get(k, 0.0) for k, v in tree_cpu(info.pids).items()}
        machine = machine_cpu_seconds() - machine
        rows = outputs(info, batch)
    mesh_tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows.values())
    flags, _ = engine_flags(repo)
    if "--scheduling-policy" not in flags:  # the mesh's engine orders job lines by priority
        flags += ["--scheduling-policy", scheduling_policy(repo)]
    theirs = chat_lines(args.prompts, args.max_tokens, ENGINE_MODEL)
    (work / "vllm").mkdir()
    vllm_s, vllm_tokens, vllm_texts = run_batch_seconds(flags, theirs, work / "vllm")
    same = sum(_content(row["response"]["body"]) == vllm_texts.get(k) for k, row in rows.items())
    mesh_rate, vllm_rate = mesh_tokens / mesh_s, vllm_tokens / max(1.0, vllm_s)
    running, waiting = occupancy.means()
    print(f"job API: the engine ran {running:.1f} requests on average ({waiting:.1f} waiting);"
          f" CPU seconds over the job ({machine / mesh_s:.1f} cores busy in all):")  # fmt: skip
    for name, seconds in sorted(used.items(), key=lambda item: -item[1]):
        per_token = 1000 * seconds / max(1, mesh_tokens)
        print(f"  {name:<22} {seconds:7.1f} s  {per_token:6.2f} ms/token")
    print(
        f"{args.prompts} prompts x {args.max_tokens} tokens at most, greedy, same engine settings"
    )
    print(f"  job API (upload to results) {mesh_tokens:>6} tokens {mesh_s:7.1f} s "
          f"{mesh_rate:7.1f} tok/s")  # fmt: skip
    print(
        f"  vLLM run_batch              {vllm_tokens:>6} tokens {vllm_s:7.1f} s "
        f"{vllm_rate:7.1f} tok/s (its progress bar: the batch without the engine's start)"
    )
    print(f"  ratio (job API / run_batch): {mesh_rate / vllm_rate:.2f}x; "
          f"{same}/{len(rows)} answers equal to run_batch's (greedy)")  # fmt: skip


MODES = {
    "embeddings": embeddings,
    "restart": restart,
    "priority": priority,
    "chat": chat,
    "run-batch": run_batch,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--lines", type=int, default=None)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--no-priority", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="priority: batch workers")
    parser.add_argument("--concurrency", type=int, default=None, help="lines per worker")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=256)
    args = parser.parse_args(argv)
    args.repository = args.repository.expanduser()
    args.lines = args.lines or {"embeddings": 500, "restart": 200, "chat": 200}.get(args.mode, 0)
    args.max_tokens = args.max_tokens or (64 if args.mode == "run-batch" else 16)
    args.concurrency = args.concurrency or (32 if args.mode == "run-batch" else 4)
    install_sigterm_exit()
    with tempfile.TemporaryDirectory(prefix="meshserve-bench-batch-") as tmp:
        MODES[args.mode](args, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
