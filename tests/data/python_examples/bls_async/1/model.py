"""BLS, concurrent: asks pytorch and add_sub at once, answers with OUTPUT0 of the
first and OUTPUT1 of the second."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [
                pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                pb_utils.get_input_tensor_by_name(request, "INPUT1"),
            ]
            answers = await asyncio.gather(
                *(
                    pb_utils.InferenceRequest(
                        model_name=name,
                        requested_output_names=["OUTPUT0", "OUTPUT1"],
                        inputs=inputs,
                    ).async_exec()
                    for name in ("pytorch", "add_sub")
                )
            )
            for answer in answers:
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.get_output_tensor_by_name(answers[0], "OUTPUT0"),
                        pb_utils.get_output_tensor_by_name(answers[1], "OUTPUT1"),
                    ]
                )
            )
        return responses
