"""The one model every server in the peer benchmark serves, and how each one gets it.

A TorchScript MLP 128 -> 512 -> 10 from a fixed seed, written once per run:

    write_torchscript()   model.pt (traced, eval mode)
    mesh_repository()     Triton's layout for the mesh: ``peer_mlp`` (no batching) and
                          ``peer_mlp_b8`` (dynamic batching, 8 rows / 5 ms), one instance,
                          one intra-op thread
    torchserve_store()    a .mar built with the real torch-model-archiver (handler.py),
                          batchSize 8 / maxBatchDelay 5 ms, one worker

KServe and the FastAPI baseline load model.pt themselves (kserve_server.py,
fastapi_server.py). Every server runs the model with one intra-op thread.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

IN_FEATURES, HIDDEN, OUT_FEATURES = 128, 512, 10
SEED = 25
MODEL = "peer_mlp"
BATCHED = "peer_mlp_b8"
HERE = Path(__file__).resolve().parent

_CONFIG = """\
name: "{name}"
backend: "pytorch"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {inputs} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {outputs} ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
"""
_BATCHING = "dynamic_batching { max_queue_delay_microseconds: 5000 }\n"


def sample_row() -> np.ndarray:
    """The request every client sends: one row of 128 float32 values."""
    return np.linspace(-1.0, 1.0, IN_FEATURES, dtype=np.float32)[None]


def write_torchscript(folder: Path) -> Path:
    """model.pt in ``folder``: the seeded MLP, traced."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        module = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT_FEATURES)
        ).eval()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.pt"
    with torch.no_grad():
        torch.jit.trace(module, torch.from_numpy(sample_row())).save(str(path))
    return path


def mesh_repository(model_pt: Path, root: Path) -> Path:
    """A repository with the MLP without batching and with batching 8 / 5 ms."""
    for name, extra in ((MODEL, ""), (BATCHED, _BATCHING)):
        version = root / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        (version / "model.pt").symlink_to(model_pt)
        config = _CONFIG.format(name=name, inputs=IN_FEATURES, outputs=OUT_FEATURES)
        (root / name / "config.pbtxt").write_text(config + extra)
    return root


def torchserve_store(model_pt: Path, work: Path) -> Path:
    """The model store with ``peer_mlp.mar`` (batch 8 / 5 ms, one worker)."""
    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    config = work / "model-config.yaml"
    config.write_text("batchSize: 8\nmaxBatchDelay: 5\nminWorkers: 1\nmaxWorkers: 1\n")
    archiver = Path(sys.executable).parent / "torch-model-archiver"
    command = [str(archiver), "--model-name", MODEL, "--version", "1.0"]
    command += ["--serialized-file", str(model_pt), "--handler", str(HERE / "handler.py")]
    command += ["--config-file", str(config), "--export-path", str(store), "--force"]
    subprocess.run(command, check=True, capture_output=True)
    return store
