"""Exceptions a user can act on. The server maps them to OpenAI error bodies in one place."""


class KestrelError(Exception):
    """Base of errors caused by user input (bad model, bad request)."""


class ModelLoadError(KestrelError):
    """A model path, file or checkpoint that cannot be loaded; the message names it."""


class UnsupportedModelError(ModelLoadError):
    """An architecture or quantization type kestrel does not serve."""


class InvalidRequestError(KestrelError, ValueError):
    """A request parameter out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
