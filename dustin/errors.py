"""User-facing errors. The CLI prints `DustinError` messages without a traceback and exits non-zero."""


class DustinError(Exception):
    """An error caused by the user's input or environment, with a message that names the problem."""

    exit_code = 2


class CheckpointError(DustinError):
    """A model folder or GGUF file is missing, corrupt, or of an unsupported architecture."""


class TokenizerMismatchError(DustinError):
    """Target and draft models do not share a tokenizer / vocabulary."""


class InputError(DustinError):
    """Bad prompt or generation parameters (too long a prompt, gamma < 1, budget out of range...)."""


class OutOfMemoryError(DustinError):
    """The requested batch does not fit in device memory."""

    exit_code = 3


class FetchError(DustinError):
    """Downloading or assembling the default model pair failed (network, checksum, interrupted)."""
