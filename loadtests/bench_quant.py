"""SmolLM2 W8A8 (int8, compressed-tensors) against the float32 model in vLLM: quality and speed.

    python -m loadtests.bench_quant [--cache DIR] [--prompts 16] [--tokens 32] [--runs 2]

Each model runs in a child process of its own (one engine at a time, so the
machine holds one engine's memory), with the engine settings the mesh gives
smollm2 (float32, eager, a small KV cache). Prints, per model, the greedy
answers' agreement with float32 on a fixed prompt set (whole answers equal,
and the share of tokens equal up to the first difference) and tokens/s for the
whole prompt set in one batch, and the ratio W8A8 / float32 per run. Where an
engine fails to load or run, the child's last error line is printed instead.
The quantized folder is built by ``python -m models.prepare --model smollm2_w8a8``
(models/smollm2_quant.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.common import ROOT, format_table, load_average

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a word that rhymes with cat.",
    "How many days are in a week?",
    "What gas do plants take in?",
    "Write one sentence about the moon.",
    "What is 7 times 8?",
    "Name a fruit that is yellow.",
    "What language is spoken in Brazil?",
    "Describe a cat in five words.",
    "What is the largest ocean?",
    "Why is the sky blue? Answer briefly.",
    "Say hello in Spanish.",
    "What do bees make?",
)


def child(model: str, prompts: int, tokens: int, quantization: str = "") -> None:
    """Run one engine on the prompt set; print one JSON line (ids per prompt, seconds)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ONEDNN_DEFAULT_FPMATH_MODE", "STRICT")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer: Any = AutoTokenizer.from_pretrained(model)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS[:prompts]
    ]
    inputs: Any = [
        {"prompt_token_ids": tokenizer.encode(c, add_special_tokens=False)} for c in chats
    ]
    llm = LLM(
        model=model,
        dtype="bfloat16" if quantization == "fp8" else "float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=16,
        quantization=quantization or None,
    )
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(inputs[:1], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"ids": ids, "seconds": seconds}), flush=True)


def run_child(model: Path, prompts: int, tokens: int, quantization: str = "") -> dict[str, Any]:
    """One child's result, or {"error": its last error line}; ``quantization``: vLLM's
    online quantization of a float model (e.g. fp8 on CUDA), none when empty."""
    command = [sys.executable, "-m", "loadtests.bench_quant", "--child", str(model)]
    command += ["--prompts", str(prompts), "--tokens", str(tokens)]
    command += ["--quantization", quantization] if quantization else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return result
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
    return {"error": (errors or done.stderr.splitlines() or ["no output"])[-1][:300]}


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """Answers equal in full, and the share of tokens equal before the first difference."""
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    prefix = 0
    for a, b in zip(reference, other, strict=True):
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            prefix += 1
    return same, prefix / max(1, sum(len(a) for a in reference))


def main(argv: list[str] | None = None) -> int:
    """Compare the two models; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshserve")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--child", type=str, default="")
    parser.add_argument("--quantization", type=str, default="")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.prompts, args.tokens, args.quantization)
        return 0
    float_dir = args.cache / "repository" / "smollm2" / "1"
    quant_dir = args.cache / "optional" / "smollm2_w8a8" / "1"
    rows = []
    for run in range(1, args.runs + 1):
        base = run_child(float_dir, args.prompts, args.tokens)
        quant = run_child(quant_dir, args.prompts, args.tokens)
        if "error" in base or "error" in quant:
            print(f"run {run}: float32 {base.get('error', 'ok')}; w8a8 {quant.get('error', 'ok')}")
            continue
        same, prefix = agreement(base["ids"], quant["ids"])
        total = args.prompts * args.tokens
        base_rate, quant_rate = total / base["seconds"], total / quant["seconds"]
        rows.append(
            [
                run,
                f"{same}/{args.prompts}",
                f"{prefix:.2f}",
                f"{base_rate:.0f}",
                f"{quant_rate:.0f}",
                f"{quant_rate / base_rate:.2f}x",
                load_average(),
            ]
        )
    headers = ["run", "same answers", "token agreement", "f32 tok/s", "w8a8 tok/s", "ratio", "load"]
    print(format_table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
