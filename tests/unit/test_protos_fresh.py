"""The checked-in generated code under protos/ matches its .proto sources.

CI runs the same `scripts/gen_protos.py --check` a person runs; a stale
`*_pb2.py` would make servers speak a protocol other than the one reviewed in
the .proto file.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"


def load_script() -> ModuleType:
    """Import scripts/gen_protos.py by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_protos", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, (
        "generated code under protos/ is stale; run `python scripts/gen_protos.py`\n"
        f"{result.stdout}{result.stderr}"
    )


def test_check_reports_edited_missing_and_orphaned_files(tmp_path: Path) -> None:
    # Guard against a --check that passes vacuously: on a copy of protos/,
    # each kind of drift must be reported.
    gen = load_script()
    proto_root = tmp_path / "protos"
    shutil.copytree(gen.PROTO_ROOT, proto_root, ignore=shutil.ignore_patterns("__pycache__"))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    gen.render(fresh, proto_root)
    assert gen.stale_files(fresh, proto_root) == []

    edited = proto_root / "inference" / "grpc_service_pb2.py"
    edited.write_text(edited.read_text() + "\n# hand edit\n")
    (proto_root / "meshserve" / "v1" / "meshserve_pb2.pyi").unlink()
    (proto_root / "inference" / "grpc_service_pb2_grpc.pyi").unlink()  # the typed stubs
    (proto_root / "inference" / "removed_pb2.py").write_text("# orphan\n")
    vendored = proto_root / "third_party" / "googleapis" / "google" / "api" / "http.proto"
    vendored.write_text("// drifted\n")

    assert gen.stale_files(fresh, proto_root) == [
        ("inference/grpc_service_pb2.py", "differs"),
        ("inference/grpc_service_pb2_grpc.pyi", "missing"),
        ("inference/removed_pb2.py", "no longer generated"),
        ("meshserve/v1/meshserve_pb2.pyi", "missing"),
        ("third_party/googleapis/google/api/http.proto", "differs"),
    ]

    gen.sync(fresh, gen.stale_files(fresh, proto_root), proto_root)
    assert gen.stale_files(fresh, proto_root) == []
    assert not (proto_root / "inference" / "removed_pb2.py").exists()


def test_descriptor_set_holds_our_files_and_their_imports(tmp_path: Path) -> None:
    from google.protobuf import descriptor_pb2

    gen = load_script()
    out = gen.build_descriptor_set(tmp_path / "meshserve.pb")
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    names = {f.name for f in fds.file}
    # Envoy's transcoder needs the http annotations and their imports too.
    assert {
        "inference/grpc_service.proto",
        "inference/model_config.proto",
        "meshserve/v1/meshserve.proto",
        "google/api/annotations.proto",
        "google/api/http.proto",
        "google/protobuf/descriptor.proto",
    } <= names
