"""The baseline: FastAPI + torch, plain JSON, no protocol, no batching.

    python fastapi_server.py MODEL_PT PORT     (in its own venv: fastapi, uvicorn, torch)

POST /predict ``{"data": [128 numbers]}`` -> ``{"outputs": [10 numbers]}``.
"""

from __future__ import annotations

import sys

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class Row(BaseModel):
    """One input row."""

    data: list[float]


def build(model_pt: str) -> FastAPI:
    """The app with the model loaded (one intra-op thread)."""
    torch.set_num_threads(1)
    module = torch.jit.load(model_pt).eval()
    app = FastAPI()

    @app.post("/predict")
    async def predict(row: Row) -> dict[str, list[float]]:
        with torch.inference_mode():
            out = module(torch.tensor([row.data], dtype=torch.float32))
        return {"outputs": out[0].tolist()}

    return app


if __name__ == "__main__":
    uvicorn.run(build(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
