"""add_sub that also counts the nanoseconds it spends in a custom counter."""

import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily(
            name="requests_process_latency_ns",
            description="Cumulative time spent processing requests",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.latency = family.Metric(labels={"model": "custom_metrics", "version": "1"})

    def execute(self, requests):
        started = time.time_ns()
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]
                )
            )
        self.latency.increment(time.time_ns() - started)
        pb_utils.Logger.log_info(f"cumulative processing: {self.latency.value()} ns")
        return responses
