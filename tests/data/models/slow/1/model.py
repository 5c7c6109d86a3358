"""Sleeps as long as asked; used to hold an RPC in flight."""

import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            ms = pb_utils.get_input_tensor_by_name(request, "MS").as_numpy()
            time.sleep(float(ms[0]) / 1000.0)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("MS_OUT", ms)]))
        return responses
