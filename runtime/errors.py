"""Typed errors. Each carries a stable ``code`` that the daemon puts on the wire."""


class LLMDError(Exception):
    code = "internal"


class InvalidRequest(LLMDError, ValueError):
    """The request itself is wrong (bad parameter, prompt too long, token id out of range)."""

    code = "invalid_request"


class ModelLoadError(LLMDError):
    """A model directory is missing, malformed or unsupported. The message names the file."""

    code = "model_load"


class EngineDirError(LLMDError):
    """An engine directory is incomplete, tampered with or from another format version."""

    code = "engine_dir"


class CapacityError(LLMDError):
    """The request can never fit in the KV pool, or the queue is full."""

    code = "capacity"
