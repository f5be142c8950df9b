"""The gateway's error answers: :class:`RequestError` is an HTTP status and an
OpenAI-style body (an API with its own error shape reshapes it, ``WireAPI.error_body``).
Every gateway module raises it, so it sits below them all.
"""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind  # the OpenAI error type when not the status's (a 429's "requests")

    def body(self) -> dict[str, Any]:
        kind = self.kind or {401: "authentication_error", 404: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.code,
            }
        }


def failure(e: BaseException, timeout: float) -> RequestError:
    """An engine call's failure as the error answer the APIs give: a :class:`RequestError`
    as raised, a timeout 504, anything else 500."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, TimeoutError):
        return RequestError(504, f"the engine did not answer within {timeout} s", code="timeout")
    return RequestError(500, f"the engine failed: {type(e).__name__}: {e}", code="engine_error")
