"""Always fails with an unexpected error carrying a secret-looking message."""


class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("secret internal detail /etc/passwd")
