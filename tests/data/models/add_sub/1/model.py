"""Sum and difference of two inputs, written against Triton's Python backend API."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if np.isnan(a).any():
                error = pb_utils.TritonError(
                    "INPUT0 contains NaN", pb_utils.TritonError.INVALID_ARG
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", (a + b).astype(np.float32)),
                        pb_utils.Tensor("OUTPUT1", (a - b).astype(np.float32)),
                    ]
                )
            )
        return responses

    def finalize(self):
        pass
