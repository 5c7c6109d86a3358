"""Regenerate the Python code for every .proto under protos/, beside the .proto files.

    python scripts/gen_protos.py            # regenerate in place
    python scripts/gen_protos.py --check    # exit 1, listing stale files, if out of date
    python scripts/gen_protos.py --descriptor-set out.pb   # also write a descriptor set

For each protos/<pkg>/<name>.proto this writes <name>_pb2.py, <name>_pb2.pyi,
<name>_pb2_grpc.py and <name>_pb2_grpc.pyi next to it, with grpc_tools.protoc (the
protoc bundled with grpcio-tools) and mypy-protobuf's protoc-gen-mypy_grpc plugin
for the typed stubs and servicers, so the output depends only on those two pinned
versions. Import
paths are relative to protos/, so with protos/ on sys.path the generated modules
import as `inference.grpc_service_pb2` and `meshserve.v1.meshserve_pb2`.

It also keeps protos/third_party/googleapis (the copy of google/api/annotations.proto
and http.proto that lets `buf lint` run offline) identical to the googleapis-common-
protos package that protoc compiles against, so the two can never disagree.

Generation always goes to a scratch folder first; the checked-in tree is then
compared with (``--check``) or synced to (default) that folder. One code path for
both modes means ``--check`` can never pass on output that a regeneration would change.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata, resources
from pathlib import Path

from google.api import annotations_pb2 as googleapis_anchor
from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "protos"

# Vendored for buf only (see protos/buf.yaml); never compiled from this copy.
VENDOR_DIR = Path("third_party") / "googleapis"
VENDORED_PROTOS = ("google/api/annotations.proto", "google/api/http.proto")

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def googleapis_include_dir() -> Path:
    """Folder holding googleapis-common-protos' google/api/*.proto (its site-packages root)."""
    # google.api is a namespace package without a usable __file__, so locate
    # the folder through a module the package ships.
    return Path(googleapis_anchor.__file__).resolve().parents[2]


def grpc_tools_include_dir() -> Path:
    """Folder holding the well-known types (google/protobuf/*.proto) bundled with grpc_tools."""
    return Path(str(resources.files("grpc_tools") / "_proto"))


def source_protos(proto_root: Path = PROTO_ROOT) -> list[str]:
    """Our .proto files, as paths relative to proto_root (the protoc import path)."""
    return sorted(
        path.relative_to(proto_root).as_posix()
        for path in proto_root.rglob("*.proto")
        if not _is_vendored(path.relative_to(proto_root))
    )


def _is_vendored(relative: Path) -> bool:
    return relative.parts[: len(VENDOR_DIR.parts)] == VENDOR_DIR.parts


def mypy_grpc_plugin() -> Path:
    """mypy-protobuf's protoc plugin, installed beside this interpreter (no PATH needed)."""
    plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    if not plugin.is_file():
        raise RuntimeError(f"{plugin} is missing: install the test extras (mypy-protobuf)")
    return plugin


def _run_protoc(args: list[str], proto_root: Path) -> None:
    include_args = [
        f"-I{proto_root}",
        f"-I{grpc_tools_include_dir()}",
        f"-I{googleapis_include_dir()}",
    ]
    # argv[0] is the program name; protoc prints its own diagnostics to stderr.
    rc = protoc.main(["grpc_tools.protoc", *include_args, *args, *source_protos(proto_root)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")


def build_descriptor_set(out_path: Path, proto_root: Path = PROTO_ROOT) -> Path:
    """Write a FileDescriptorSet of our protos and all their imports (for Envoy transcoding)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _run_protoc(["--include_imports", f"--descriptor_set_out={out_path}"], proto_root)
    return out_path


def render(out_dir: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Write every file this script owns under protos/ into out_dir, mirroring the layout."""
    _run_protoc(
        [
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--plugin=protoc-gen-mypy_grpc={mypy_grpc_plugin()}",
            "--mypy_grpc_opt=quiet",
            f"--mypy_grpc_out={out_dir}",
        ],
        proto_root,
    )
    googleapis = googleapis_include_dir()
    for name in VENDORED_PROTOS:
        target = out_dir / VENDOR_DIR / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(googleapis / name, target)


def owned_files(root: Path) -> set[str]:
    """Files under root that this script produces: generated code plus the vendored protos."""
    owned = {
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_file() and path.name.endswith(GENERATED_SUFFIXES)
    }
    owned.update((VENDOR_DIR / name).as_posix() for name in VENDORED_PROTOS)
    return owned


def stale_files(fresh_dir: Path, proto_root: Path = PROTO_ROOT) -> list[tuple[str, str]]:
    """(path, reason) for each checked-in file that differs from the fresh rendering."""
    fresh = owned_files(fresh_dir)
    current = {name for name in owned_files(proto_root) if (proto_root / name).is_file()}
    stale = [(name, "missing") for name in sorted(fresh - current)]
    stale += [(name, "no longer generated") for name in sorted(current - fresh)]
    stale += [
        (name, "differs")
        for name in sorted(fresh & current)
        if not filecmp.cmp(fresh_dir / name, proto_root / name, shallow=False)
    ]
    return sorted(stale)


def sync(fresh_dir: Path, stale: list[tuple[str, str]], proto_root: Path = PROTO_ROOT) -> None:
    """Make the checked-in tree match fresh_dir for the given stale paths."""
    for name, _reason in stale:
        source, target = fresh_dir / name, proto_root / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        else:
            target.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate (or with --check, verify) the generated code under protos/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 and list the stale files if regeneration would differ",
    )
    parser.add_argument(
        "--descriptor-set",
        type=Path,
        metavar="PATH",
        help="also write a FileDescriptorSet (with imports) to PATH; not written by default",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gen_protos_") as scratch:
        fresh_dir = Path(scratch)
        render(fresh_dir)
        stale = stale_files(fresh_dir)
        if args.check:
            if stale:
                tools = metadata.version("grpcio-tools")
                typed = metadata.version("mypy-protobuf")
                print(
                    f"stale generated files under protos/ "
                    f"(grpcio-tools {tools}, mypy-protobuf {typed}):"
                )
                for name, reason in stale:
                    print(f"  protos/{name}: {reason}")
                print("run: python scripts/gen_protos.py")
                return 1
            print("protos/: generated code is up to date")
        else:
            sync(fresh_dir, stale)
            for name, reason in stale:
                print(f"updated protos/{name} ({reason})")
            print(f"protos/: {len(stale)} file(s) updated")

    if args.descriptor_set is not None:
        print(f"wrote {build_descriptor_set(args.descriptor_set)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
