"""The error a request gets: OpenAI's format, {"error": {"message", "type", "param", "code"}}."""


class APIError(Exception):
    """An error sent to the client as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}


def error_body(err: APIError) -> dict:
    message = err.message.encode("utf-8", "replace").decode("utf-8")   # (a lone surrogate echoed from the input)
    return {"error": {"message": message, "type": err.type, "param": err.param, "code": err.code}}
