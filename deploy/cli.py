"""The ``meshserve`` command: serve a model repository, and manage a running mesh's models.

    meshserve serve [--model-repository DIR] [--config mesh.yaml] [--ports auto]
    meshserve models [--url HOST:PORT]
    meshserve load NAME [--config JSON] [--url HOST:PORT]
    meshserve unload NAME [--url HOST:PORT]
    meshserve route list|status|set|define|promote|rollback|delete ... (docs/traffic-management.md)

``serve`` runs the local supervisor (deploy/local/supervisor.py) on any
Triton-layout repository; without one it prepares the default models into the
cache folder first, as ``make run`` does. The other commands speak KServe v2
gRPC to the orchestrator, so they work against any Triton-compatible server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import grpc

from deploy import job_cli, mar_import, route_cli, trace_cli
from deploy.local import supervisor
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc

DEFAULT_URL = "127.0.0.1:8001"
"""The orchestrator's KServe v2 gRPC port in deploy/local/mesh.yaml."""
LOAD_TIMEOUT_S = 600.0
"""A load waits for the model to be ready; an LLM engine takes a while to start."""
QUERY_TIMEOUT_S = 30.0


def serve(args: argparse.Namespace) -> int:
    """Start the whole mesh on a model repository (default: the default models)."""
    if args.model_repository is None:
        from models.prepare import default_cache, prepare_repository
        from models.sources import MissingSource

        try:
            # Progress goes to stderr: stdout carries the mesh's ready line.
            args.model_repository = prepare_repository(default_cache(), echo=_progress)
        except MissingSource as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return supervisor.run(args)


def _progress(message: str) -> None:
    print(f"[models] {message}", file=sys.stderr, flush=True)


def list_models(args: argparse.Namespace) -> int:
    """Print every model the server knows, with its state (and why, where it failed)."""
    reply = _stub(args.url).RepositoryIndex(pb.RepositoryIndexRequest(), timeout=QUERY_TIMEOUT_S)
    rows = [(m.name, m.version or "-", m.state or "-", m.reason) for m in reply.models]
    width = max([len("MODEL"), *(len(row[0]) for row in rows)])
    print(f"{'MODEL':<{width}}  {'VERSION':<7}  {'STATE':<11}  REASON")
    for name, version, state, reason in sorted(rows):
        print(f"{name:<{width}}  {version:<7}  {state:<11}  {reason}".rstrip())
    return 0


def load(args: argparse.Namespace) -> int:
    """Load (or reload) a model, optionally with a JSON config that overrides its config.pbtxt."""
    parameters = {}
    if args.config is not None:
        parameters["config"] = pb.ModelRepositoryParameter(string_param=args.config)
    request = pb.RepositoryModelLoadRequest(model_name=args.name, parameters=parameters)
    _stub(args.url).RepositoryModelLoad(request, timeout=LOAD_TIMEOUT_S)
    print(f"loaded '{args.name}'")
    return 0


def unload(args: argparse.Namespace) -> int:
    """Unload a model: it stops serving; its files stay in the repository."""
    request = pb.RepositoryModelUnloadRequest(model_name=args.name)
    _stub(args.url).RepositoryModelUnload(request, timeout=LOAD_TIMEOUT_S)
    print(f"unloaded '{args.name}'")
    return 0


def _stub(url: str) -> pb_grpc.GRPCInferenceServiceStub:
    channel = grpc.insecure_channel(url)
    return pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshserve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    serve_parser = _command(commands, "serve", serve)
    supervisor.add_arguments(
        serve_parser,
        repository_default="default: the default models, prepared in $MESHSERVE_CACHE "
        "or ~/.cache/meshserve",
    )
    _url(_command(commands, "models", list_models))
    load_parser = _command(commands, "load", load)
    load_parser.add_argument("name", help="the model's folder name in the repository")
    load_parser.add_argument(
        "--config",
        help="JSON config overriding the model's config.pbtxt, e.g. '{\"max_batch_size\": 4}'",
    )
    _url(load_parser)
    unload_parser = _command(commands, "unload", unload)
    unload_parser.add_argument("name", help="the model to unload")
    _url(unload_parser)
    mar_import.add_arguments(_command(commands, "import-mar", mar_import.import_mar))
    job_cli.add_command(commands)
    route_cli.add_command(commands)
    trace_cli.add_arguments(_command(commands, "trace", trace_cli.trace))
    return parser


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """A subcommand whose help and description are its handler's docstring."""
    summary = (handler.__doc__ or "").strip().splitlines()[0]
    command = commands.add_parser(name, help=summary, description=summary)
    command.set_defaults(handler=handler)
    return command


def _url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="the orchestrator's (or any KServe v2 server's) gRPC address (default: %(default)s)",
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``meshserve`` console script."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except grpc.RpcError as exc:
        # The server's own words: they name the model and what went wrong.
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        print(f"error: {details} ({code.name if code else 'unknown'})", file=sys.stderr)
        status = 1
    raise SystemExit(status)


if __name__ == "__main__":
    main()
