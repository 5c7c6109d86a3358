"""Quantized SmolLM2 on CUDA: W8A8 (the prepared int8 folder) and FP8 against float.

On a machine with a GPU and the CUDA build of vLLM (``make`` picks ``vllm``
where ``nvidia-smi`` exists), after ``python -m models.prepare``:

    python -m loadtests.gpu_check_quant [--cache DIR] [--tokens 32]

Each engine runs alone in a child process (loadtests/bench_quant.py's). Rows:
float32, the W8A8 compressed-tensors folder (cutlass int8 kernels on CUDA), and
vLLM's online FP8 quantization of the float model (``quantization="fp8"``,
bfloat16 activations; needs compute capability 8.9+, else vLLM's error is
printed). Each row: greedy agreement with float32 and tokens/s. AWQ and GPTQ
need checkpoints quantized with calibration data (none ship on PyPI for this
model); their CPU kernels are listed in docs/lora-and-quantization.md. Without
CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from loadtests.bench_quant import PROMPTS, agreement, run_child
from loadtests.common import format_table


def main(argv: list[str] | None = None) -> int:
    """Run the three engines; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshserve")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        print("CUDA not available (no nvidia-smi): nothing to check here")
        return 0
    float_dir = args.cache / "repository" / "smollm2" / "1"
    quant_dir = args.cache / "optional" / "smollm2_w8a8" / "1"
    prompts = len(PROMPTS)
    reference = run_child(float_dir, prompts, args.tokens)
    if "error" in reference:
        print(f"float32 failed: {reference['error']}")
        return 1
    rows = [["float32", "-", "-", f"{prompts * args.tokens / reference['seconds']:.0f}"]]
    for label, folder, quantization in (("w8a8", quant_dir, ""), ("fp8", float_dir, "fp8")):
        result = run_child(folder, prompts, args.tokens, quantization)
        if "error" in result:
            rows.append([label, "error", result["error"], "-"])
            continue
        same, prefix = agreement(reference["ids"], result["ids"])
        rate = prompts * args.tokens / result["seconds"]
        rows.append([label, f"{same}/{prompts}", f"{prefix:.2f}", f"{rate:.0f}"])
    print(format_table(["model", "same answers", "token agreement", "tok/s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
