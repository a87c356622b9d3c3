"""llmd clients: the Python client, editor plugin, voice bridge and batch runner. Never imports torch."""
from .client import AsyncClient, Client, ConnectionLost, DaemonUnavailable, RequestError, Timeout
from llmd.protocol import Done, Error, Sentence, Token

__all__ = ["Client", "AsyncClient", "DaemonUnavailable", "ConnectionLost", "Timeout", "RequestError",
           "Token", "Sentence", "Done", "Error"]
