"""One exception hierarchy for the library; the HTTP layer maps these to status codes in one place."""


class OdmaError(Exception):
    """Base class of every error odma raises on purpose."""


class ConfigError(OdmaError, ValueError):
    """A configuration value is out of range or inconsistent."""


class InvalidRequestError(OdmaError, ValueError):
    """A request (lengths, ids, parameters) is malformed; nothing was changed."""


class RequestTooLargeError(InvalidRequestError):
    """The request could never fit, even in an empty pool."""


class UnknownRequestError(OdmaError, KeyError):
    """The request id is not live in this pool (never reserved, or already released)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(OdmaError):
    """The request id already holds a block."""


class TraceError(OdmaError, ValueError):
    """A trace name is unknown, or a trace file is missing or malformed."""


class PredictorError(OdmaError):
    """A predictor could not be loaded or used (missing or corrupt checkpoint, bad input)."""
