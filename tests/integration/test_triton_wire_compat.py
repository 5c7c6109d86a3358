"""Our protos/inference schema is wire- and name-identical to tritonclient's.

Every meshserve hop speaks `inference.GRPCInferenceService`, and users point
tritonclient (and real Tritons) at it, so each message, field (name, number,
type, label, oneof, map-ness), enum value and RPC must match Triton's exactly.

tritonclient ships its own generated `inference` package, and protobuf's
default descriptor pool refuses a second definition of the same symbols, so
the comparison runs in a child process that imports only tritonclient. Our
side never goes through our _pb2 modules: protoc compiles protos/ into a
FileDescriptorSet, which the child parses as plain data. The child is this
file run as a script; it prints a JSON report that the test asserts on.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"
PACKAGE = "inference"

FieldProto = descriptor_pb2.FieldDescriptorProto
Schema = dict[str, dict[str, Any]]


# --------------------------------------------------------------- comparison
# Pure functions over descriptor protos, shared by the child (real check) and
# the parent (self-test that the comparison is not vacuous).


def _local(type_name: str) -> str:
    """'.inference.ModelConfig.ParametersEntry' -> 'ModelConfig.ParametersEntry'."""
    return type_name.lstrip(".").removeprefix(PACKAGE + ".")


def _walk(
    prefix: str, messages: Iterable[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for message in messages:
        name = f"{prefix}{message.name}"
        yield name, message
        yield from _walk(name + ".", message.nested_type)


def schema_of(files: Iterable[descriptor_pb2.FileDescriptorProto]) -> Schema:
    """Index the `inference` package of files by package-local names."""
    files = [f for f in files if f.package == PACKAGE]
    messages = dict(item for f in files for item in _walk("", f.message_type))
    enums = {e.name: e for f in files for e in f.enum_type}
    for name, message in messages.items():
        enums.update({f"{name}.{e.name}": e for e in message.enum_type})
    return {
        "files": {Path(f.name).name: f for f in files},
        "messages": messages,
        "enums": enums,
        "services": {s.name: s for f in files for s in f.service},
    }


def _field_facts(
    field: FieldProto, message: descriptor_pb2.DescriptorProto, messages: dict[str, Any]
) -> dict[str, Any]:
    entry = messages.get(_local(field.type_name)) if field.type_name else None
    return {
        "number": field.number,
        "type": FieldProto.Type.Name(field.type),
        "label": FieldProto.Label.Name(field.label),
        "type_name": _local(field.type_name),
        "oneof": (
            message.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
        ),
        "proto3_optional": field.proto3_optional,
        "map": bool(entry is not None and entry.options.map_entry),
        "packed": field.options.packed if field.options.HasField("packed") else None,
        "default": field.default_value,
    }


def _diff_keys(kind: str, theirs: Iterable[str], ours: Iterable[str]) -> list[str]:
    theirs, ours = set(theirs), set(ours)
    return [f"missing {kind}: {n}" for n in sorted(theirs - ours)] + [
        f"extra {kind} (not in Triton): {n}" for n in sorted(ours - theirs)
    ]


def _diff_message(name: str, theirs: Schema, ours: Schema) -> list[str]:
    t_msg, o_msg = theirs["messages"][name], ours["messages"][name]
    diffs = _diff_keys(
        f"field in {name}", (f.name for f in t_msg.field), (f.name for f in o_msg.field)
    )
    diffs += _diff_keys(
        f"oneof in {name}", (o.name for o in t_msg.oneof_decl), (o.name for o in o_msg.oneof_decl)
    )
    if t_msg.options.map_entry != o_msg.options.map_entry:
        diffs.append(f"{name}: map_entry {t_msg.options.map_entry} != {o_msg.options.map_entry}")
    o_fields = {f.name: f for f in o_msg.field}
    for t_field in t_msg.field:
        if t_field.name not in o_fields:
            continue
        want = _field_facts(t_field, t_msg, theirs["messages"])
        got = _field_facts(o_fields[t_field.name], o_msg, ours["messages"])
        diffs += [
            f"{name}.{t_field.name}: {key} is {got[key]!r}, Triton has {want[key]!r}"
            for key in want
            if want[key] != got[key]
        ]
    return diffs


def _diff_enum(name: str, theirs: Schema, ours: Schema) -> list[str]:
    t_values = {v.name: v.number for v in theirs["enums"][name].value}
    o_values = {v.name: v.number for v in ours["enums"][name].value}
    diffs = _diff_keys(f"value in enum {name}", t_values, o_values)
    diffs += [
        f"enum {name}.{value}: number is {o_values[value]}, Triton has {number}"
        for value, number in t_values.items()
        if value in o_values and o_values[value] != number
    ]
    return diffs


def _diff_service(name: str, theirs: Schema, ours: Schema) -> list[str]:
    def facts(service: descriptor_pb2.ServiceDescriptorProto) -> dict[str, tuple[Any, ...]]:
        return {
            m.name: (
                _local(m.input_type),
                _local(m.output_type),
                m.client_streaming,
                m.server_streaming,
            )
            for m in service.method
        }

    t_rpcs, o_rpcs = facts(theirs["services"][name]), facts(ours["services"][name])
    diffs = _diff_keys(f"rpc in {name}", t_rpcs, o_rpcs)
    diffs += [
        f"rpc {name}.{rpc}: (input, output, client_streaming, server_streaming) is "
        f"{o_rpcs[rpc]}, Triton has {sig}"
        for rpc, sig in t_rpcs.items()
        if rpc in o_rpcs and o_rpcs[rpc] != sig
    ]
    return diffs


def compare(
    triton_files: Iterable[descriptor_pb2.FileDescriptorProto],
    our_files: Iterable[descriptor_pb2.FileDescriptorProto],
) -> dict[str, Any]:
    """Every difference between Triton's `inference` schema and ours, plus what was compared."""
    theirs, ours = schema_of(triton_files), schema_of(our_files)
    diffs = _diff_keys("file", theirs["files"], ours["files"])
    for file_name in sorted(theirs["files"].keys() & ours["files"].keys()):
        t_syntax = theirs["files"][file_name].syntax
        o_syntax = ours["files"][file_name].syntax
        if t_syntax != o_syntax:  # proto2 vs proto3 changes packing and presence
            diffs.append(f"{file_name}: syntax {o_syntax!r}, Triton has {t_syntax!r}")
    for kind, differ in (
        ("messages", _diff_message),
        ("enums", _diff_enum),
        ("services", _diff_service),
    ):
        diffs += _diff_keys(kind[:-1], theirs[kind], ours[kind])
        for name in sorted(theirs[kind].keys() & ours[kind].keys()):
            diffs += differ(name, theirs, ours)
    return {
        "differences": diffs,
        "counts": {
            "messages": len(theirs["messages"]),
            "fields": sum(len(m.field) for m in theirs["messages"].values()),
            "enums": len(theirs["enums"]),
            "enum_values": sum(len(e.value) for e in theirs["enums"].values()),
            "rpcs": sum(len(s.method) for s in theirs["services"].values()),
        },
    }


# -------------------------------------------------------------- child side


def child_main(descriptor_set_path: str) -> None:
    """Compare tritonclient's descriptors with our descriptor set; print a JSON report."""
    from importlib import metadata

    from tritonclient.grpc import model_config_pb2, service_pb2

    triton_files = []
    for module in (model_config_pb2, service_pb2):
        file_proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(file_proto)
        triton_files.append(file_proto)
    ours = descriptor_pb2.FileDescriptorSet.FromString(Path(descriptor_set_path).read_bytes())
    report = compare(triton_files, ours.file)
    report["tritonclient"] = metadata.version("tritonclient")
    print(json.dumps(report))


# ------------------------------------------------------------- parent side


def our_descriptor_set(out_path: Path) -> Path:
    """Compile protos/ with protoc (--include_imports) via scripts/gen_protos.py."""
    spec = importlib.util.spec_from_file_location("gen_protos", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return Path(gen.build_descriptor_set(out_path))


def test_inference_protos_match_tritonclient(tmp_path: Path) -> None:
    descriptor_set = our_descriptor_set(tmp_path / "ours.pb")
    child = subprocess.run(
        [sys.executable, __file__, str(descriptor_set)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, f"comparison process failed:\n{child.stderr}"
    report = json.loads(child.stdout)

    differences = report["differences"]
    assert not differences, (
        f"{len(differences)} difference(s) from tritonclient {report['tritonclient']}:\n  "
        + "\n  ".join(differences)
    )
    counts = report["counts"]
    # Guard against comparing two empty schemas (e.g. a package rename).
    assert counts["messages"] > 50, counts
    assert counts["fields"] > 200, counts
    assert counts["enums"] >= 9, counts
    assert counts["enum_values"] > 30, counts
    assert counts["rpcs"] >= 20, counts


def test_comparison_catches_wire_changes(tmp_path: Path) -> None:
    # Mutate a copy of our own schema the ways that break Triton clients and
    # check each is reported: a green compat test must mean something.
    files = list(
        descriptor_pb2.FileDescriptorSet.FromString(
            our_descriptor_set(tmp_path / "ours.pb").read_bytes()
        ).file
    )
    mutated = [descriptor_pb2.FileDescriptorProto.FromString(f.SerializeToString()) for f in files]
    schema = schema_of(mutated)
    request = schema["messages"]["ModelInferRequest"]
    next(f for f in request.field if f.name == "raw_input_contents").number = 99
    parameter = schema["messages"]["InferParameter"]
    next(f for f in parameter.field if f.name == "uint64_param").ClearField("oneof_index")
    next(v for v in schema["enums"]["DataType"].value if v.name == "TYPE_BF16").number = 15
    stream = next(
        m for m in schema["services"]["GRPCInferenceService"].method if m.name == "ModelStreamInfer"
    )
    stream.client_streaming = False
    del schema["messages"]["ModelConfig"].field[-1]

    assert compare(files, files)["differences"] == []
    differences = compare(files, mutated)["differences"]
    assert sorted(differences) == sorted(
        [
            "ModelInferRequest.raw_input_contents: number is 99, Triton has 7",
            "InferParameter.uint64_param: oneof is None, Triton has 'parameter_choice'",
            "enum DataType.TYPE_BF16: number is 15, Triton has 14",
            "rpc GRPCInferenceService.ModelStreamInfer: (input, output, client_streaming, "
            "server_streaming) is ('ModelInferRequest', 'ModelStreamInferResponse', False, True), "
            "Triton has ('ModelInferRequest', 'ModelStreamInferResponse', True, True)",
            "missing field in ModelConfig: model_metrics",
        ]
    )


if __name__ == "__main__":
    child_main(sys.argv[1])
