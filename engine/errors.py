"""User-facing errors: each names the problem and what to do. The CLI prints them without a traceback."""


class LlamatermError(Exception):
    """Base class: str(err) is a complete message for the user."""


class ModelNotFound(LlamatermError):
    pass


class ModelFormatError(LlamatermError):
    """A checkpoint that is corrupt, truncated, or uses an architecture / tensor type we do not support."""


class RequestError(LlamatermError):
    """A request that cannot be served: empty prompt, over the context, invalid sampling values."""
