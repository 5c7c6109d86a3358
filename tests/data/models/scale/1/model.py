"""Y = X * factor, after an optional sleep (to make concurrency observable)."""

import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.factor = float(parameters["factor"]["string_value"])
        self.sleep_s = float(parameters["sleep_ms"]["string_value"]) / 1000.0

    def execute(self, requests):
        time.sleep(self.sleep_s)
        return [
            pb_utils.InferenceResponse(
                [
                    pb_utils.Tensor(
                        "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * self.factor
                    )
                ]
            )
            for r in requests
        ]
