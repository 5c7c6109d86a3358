"""Decoupled: one response per element of IN (OUT = the element, IDX = its index),
the i-th after DELAY[i] ms, sent from a thread of its own; execute returns
after WAIT ms, so the responses of several requests may interleave."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("repeat_int32 must be decoupled")
        self.out_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUT")["data_type"]
        )
        self.idx_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "IDX")["data_type"]
        )
        self.running = 0
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            if values.shape != delays.shape:
                raise pb_utils.TritonModelException(
                    f"IN and DELAY differ in shape: {list(values.shape)} and {list(delays.shape)}"
                )
            with self.lock:
                self.running += 1
            sender = request.get_response_sender()
            threading.Thread(
                target=self.respond, args=(sender, values, delays), daemon=True
            ).start()
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
            time.sleep(int(wait[0]) / 1000)

    def respond(self, sender, values, delays):
        try:
            for index, (value, delay) in enumerate(zip(values, delays, strict=True)):
                time.sleep(int(delay) / 1000)
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor("OUT", np.array([value], self.out_dtype)),
                            pb_utils.Tensor("IDX", np.array([index], self.idx_dtype)),
                        ]
                    )
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.running -= 1

    def finalize(self):
        while True:
            with self.lock:
                if self.running == 0:
                    return
            time.sleep(0.05)
