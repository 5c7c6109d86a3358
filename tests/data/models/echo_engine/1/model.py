"""Streams the last ECHOED prompt ids back one per response, as the vLLM
backend streams a generation: every id so far, how many are new, and the
finish reason ("length") on the last."""

import numpy as np
import triton_python_backend_utils as pb_utils

ECHOED = 6


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
            prompt = prompt.reshape(-1)
            echo = [int(i) for i in prompt[-ECHOED:]]
            sender = request.get_response_sender()
            for count in range(1, len(echo) + 1):
                finish = b"length" if count == len(echo) else b""
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor("OUTPUT_IDS", np.array(echo[:count], np.int64)),
                            pb_utils.Tensor("NEW_TOKENS", np.array([1], np.int32)),
                            pb_utils.Tensor("ENGINE_FINISH", np.array([finish], dtype=object)),
                            pb_utils.Tensor("PROMPT_TOKENS", np.array([prompt.size], np.int32)),
                            pb_utils.Tensor("COMPLETION_TOKENS", np.array([count], np.int32)),
                            # No logprobs asked for: none, as the vLLM backend sends then.
                            pb_utils.Tensor("LOGPROB_IDS", np.zeros((0, 0), np.int64)),
                            pb_utils.Tensor("LOGPROBS", np.zeros((0, 0), np.float32)),
                        ]
                    )
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
