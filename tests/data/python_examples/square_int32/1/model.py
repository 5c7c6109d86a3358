"""Decoupled: for IN = [n], n responses each with OUT = [n] (n = 0: none at all)."""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("square_int32 must be decoupled")
        for kind, name in (("input", "IN"), ("output", "OUT")):
            entry = (
                pb_utils.get_input_config_by_name
                if kind == "input"
                else pb_utils.get_output_config_by_name
            )(config, name)
            if entry["dims"] != [1] or entry["data_type"] != "TYPE_INT32":
                raise pb_utils.TritonModelException(f"{name} must be TYPE_INT32 [1], got {entry}")
        self.threads = []

    def execute(self, requests):
        for request in requests:
            count = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            thread = threading.Thread(
                target=self.respond,
                args=(request.get_response_sender(), int(count[0])),
                daemon=True,
            )
            thread.start()
            self.threads.append(thread)

    def respond(self, sender, count):
        for _ in range(count):
            if sender.is_cancelled():
                break
            sender.send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([count], np.int32))])
            )
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=10)
