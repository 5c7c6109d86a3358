"""Build TorchServe archives at test time with the real torch-model-archiver.

Nothing here is checked in as a binary: the TorchScript model is scripted from
a few seeded layers and the MobileNetV2 archive reuses the prepared
repository's TorchScript file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ARCHIVER = Path(sys.executable).parent / "torch-model-archiver"
KITTEN_LABELS = ["tabby", "tiger cat", "persian cat", "lynx"]


class _TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4)
        )
        self.head = torch.nn.Linear(8 * 16, len(KITTEN_LABELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.flatten(self.features(x), 1))
        return logits


def archive(
    work: Path,
    store: Path,
    name: str,
    handler: str,
    files: dict[str, Path],
    serialized: Path | None,
    config: str | None = None,
    version: str = "1.0",
    folder: bool = False,
) -> Path:
    """``torch-model-archiver`` over the given files; the .mar's path."""
    extra = [str(path) for path in files.values()]
    command = [
        str(ARCHIVER),
        "--model-name",
        name,
        "--version",
        version,
        "--handler",
        handler,
        "--export-path",
        str(store),
        "--force",
        *(["--archive-format", "no-archive"] if folder else []),
    ]
    if serialized is not None:
        command += ["--serialized-file", str(serialized)]
    if extra:
        command += ["--extra-files", ",".join(extra)]
    if config is not None:
        config_path = work / f"{name}-config.yaml"
        config_path.write_text(config)
        command += ["--config-file", str(config_path)]
    store.mkdir(parents=True, exist_ok=True)
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    return store / (name if folder else f"{name}.mar")


def kitten_mar(
    work: Path, store: Path, name: str = "kitten", config: str | None = None, version: str = "1.0"
) -> Path:
    """A scripted image model with the custom KittenHandler."""
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model_file = work / "kitten.pt"
    with warnings.catch_warnings():  # TorchScript is what a .mar's serialized file is
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted: Any = torch.jit.script(_TinyNet().eval())
    scripted.save(str(model_file))
    labels = work / "index_to_name.json"
    labels.write_text(json.dumps({str(i): label for i, label in enumerate(KITTEN_LABELS)}))
    handler = work / "kitten_handler.py"
    shutil.copy(HERE / "kitten_handler.py", handler)
    return archive(work, store, name, str(handler), {"labels": labels}, model_file, config, version)


def mobilenet_mar(work: Path, store: Path, prepared: Path, name: str = "mobilenet_ts") -> Path:
    """The repository's MobileNetV2 (TorchScript) under TorchServe's built-in image_classifier,
    as an unpacked archive (``--archive-format no-archive``: no 14 MB to deflate)."""
    work.mkdir(parents=True, exist_ok=True)
    labels_txt = (prepared / "mobilenet_v2" / "labels.txt").read_text().splitlines()
    labels = work / "index_to_name.json"
    labels.write_text(json.dumps({str(i): label for i, label in enumerate(labels_txt)}))
    model = prepared / "mobilenet_v2" / "1" / "model.pt"
    return archive(work, store, name, "image_classifier", {"labels": labels}, model, folder=True)


def echo_mar(work: Path, store: Path, version: str = "1.0", name: str = "echo") -> Path:
    """A function-entry handler that streams intermediate responses (no model file)."""
    work.mkdir(parents=True, exist_ok=True)
    handler = work / "echo_handler.py"
    shutil.copy(HERE / "echo_handler.py", handler)
    return archive(work, store, name, str(handler), {}, None, version=version)
