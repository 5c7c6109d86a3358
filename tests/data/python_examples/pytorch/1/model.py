"""The same sums and differences, computed by a torch module."""

import json

import torch
import triton_python_backend_utils as pb_utils


class SumAndDifference(torch.nn.Module):
    def forward(self, left, right):
        return left + right, left - right


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.out_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUTPUT0")["data_type"]
        )
        self.module = SumAndDifference().eval()

    def execute(self, requests):
        responses = []
        for request in requests:
            left = torch.from_numpy(
                pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy().copy()
            )
            right = torch.from_numpy(
                pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy().copy()
            )
            with torch.inference_mode():
                total, difference = self.module(left, right)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", total.numpy().astype(self.out_dtype)),
                        pb_utils.Tensor.from_dlpack("OUTPUT1", difference.contiguous()),
                    ]
                )
            )
        return responses
