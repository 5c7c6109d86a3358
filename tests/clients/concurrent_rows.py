"""Many concurrent callers with distinct inputs; each must get exactly its own rows.

argv: url, model, input name, output name, callers, rows per caller, inputs.npz, outputs.npz
Saves every caller's output to outputs.npz (key "caller<i>"), prints the model's
batch statistics as JSON.
"""

import asyncio
import json
import sys

import numpy as np
import tritonclient.grpc.aio as aioclient

url, model, in_name, out_name, callers, rows, in_path, out_path = (
    json.loads(a) for a in sys.argv[1:9]
)
arrays = np.load(in_path)


async def main():
    async with aioclient.InferenceServerClient(url) as client:

        async def call(index):
            data = arrays[f"caller{index}"]
            tensor = aioclient.InferInput(in_name, list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            result = await client.infer(model, [tensor])
            return result.as_numpy(out_name)

        outputs = await asyncio.gather(*(call(i) for i in range(callers)))
        stats = await client.get_inference_statistics(model, as_json=True)
    np.savez(out_path, **{f"caller{i}": out for i, out in enumerate(outputs)})
    model_stats = stats["model_stats"][0]
    print(
        json.dumps(
            {
                "batch_sizes": sorted(
                    int(b["batch_size"]) for b in model_stats.get("batch_stats", [])
                ),
                "execution_count": int(model_stats.get("execution_count", 0)),
                "inference_count": int(model_stats.get("inference_count", 0)),
            }
        )
    )


asyncio.run(main())
