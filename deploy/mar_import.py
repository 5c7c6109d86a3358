"""``meshserve import-mar x.mar --repository DIR``: a TorchServe model store becomes a
model repository once.

Each archive becomes a Triton-layout model folder (config.pbtxt, the archive's
files in a version folder) served by the inference stage's ``torchserve``
backend; its batching and workers come from the archive's model-config.yaml,
then ``--config-properties`` (TorchServe's config.properties), then the flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.inference.torchserve_archive import import_archive, read_properties
from shared.errors import MeshError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("archives", nargs="+", type=Path, help=".mar files (or unpacked folders)")
    parser.add_argument(
        "--repository", type=Path, required=True, help="the model repository to write into"
    )
    parser.add_argument("--model-name", help="register under this name (one archive only)")
    parser.add_argument(
        "--config-properties", type=Path, help="TorchServe's config.properties (models, defaults)"
    )
    parser.add_argument("--batch-size", type=int, help="batchSize (overrides the archive's)")
    parser.add_argument("--max-batch-delay", type=int, help="maxBatchDelay in ms")
    parser.add_argument("--workers", type=int, help="minWorkers: the model's instances")


def import_mar(args: argparse.Namespace) -> int:
    """Write TorchServe archives (.mar) into a model repository as model folders."""
    if args.model_name and len(args.archives) > 1:
        print("error: --model-name names one archive only", file=sys.stderr)
        return 2
    properties = read_properties(args.config_properties) if args.config_properties else {}
    overrides = {
        key: value
        for key, value in (
            ("batch_size", args.batch_size),
            ("max_batch_delay_ms", args.max_batch_delay),
            ("min_workers", args.workers),
        )
        if value is not None
    }
    status = 0
    for archive in args.archives:
        try:
            done = import_archive(archive, args.repository, args.model_name, overrides, properties)
        except MeshError as exc:
            print(f"error: {archive}: {exc.message}", file=sys.stderr)
            status = 1
            continue
        where = args.repository / done.name / str(done.folder)
        settings = done.settings
        print(
            f"{archive.name}: model '{done.name}' version {done.version} -> {where} "
            f"(batch {settings.batch_size}, delay {settings.max_batch_delay_ms} ms, "
            f"workers {settings.min_workers})"
        )
    return status
