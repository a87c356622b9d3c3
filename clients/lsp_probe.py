"""A small LSP client that drives ``llmd lsp`` the way an editor does, over stdio.

Used by the end-to-end tests and the editor benchmark, and handy to check an install::

    async with LspProbe(["--socket", path]) as lsp:
        lsp.open("file:///a.py", "def f(x):\\n    return ")
        text = await lsp.inline("file:///a.py", 1, 11)

Built on pygls's LanguageClient; the server runs as ``python -m llmd.clients.cli lsp ARGS`` (the same as ``llmd lsp``).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from .lsp import STATS_COMMAND, STATUS_COMMAND


class LspProbe:
    def __init__(self, server_args: Sequence[str] = (), python: str = sys.executable, cwd: Optional[str] = None):
        self.server_args = list(server_args)
        self.python, self.cwd = python, cwd
        self.client = LanguageClient("llmd-probe", "1")
        self.capabilities: Optional[types.ServerCapabilities] = None
        self._versions: dict[str, int] = {}

    async def __aenter__(self) -> "LspProbe":
        await self.client.start_io(self.python, "-m", "llmd.clients.cli", "lsp", *self.server_args, cwd=self.cwd)
        result = await self.client.initialize_async(types.InitializeParams(
            capabilities=types.ClientCapabilities(), process_id=None, root_uri=None))
        self.capabilities = result.capabilities
        self.client.initialized(types.InitializedParams())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.shutdown_async(None)
        self.client.exit(None)
        await self.client.stop()

    def open(self, uri: str, text: str, language: str = "python") -> None:
        self._versions[uri] = 1
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id=language, version=1, text=text)))

    def insert(self, uri: str, line: int, character: int, text: str) -> None:
        """Type ``text`` at (line, character), as an incremental didChange."""
        self._versions[uri] += 1
        at = types.Position(line=line, character=character)
        change = types.TextDocumentContentChangePartial(range=types.Range(start=at, end=at), text=text)
        self.client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=self._versions[uri]),
            content_changes=[change]))

    def inline_future(self, uri: str, line: int, character: int):
        """Send an inline completion request; the awaitable answers the raw result."""
        return self.client.text_document_inline_completion_async(types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri), position=types.Position(line=line, character=character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic)))

    async def inline(self, uri: str, line: int, character: int) -> Optional[str]:
        """The suggested text at (line, character), or None."""
        return first_text(await self.inline_future(uri, line, character))

    async def completion(self, uri: str, line: int, character: int):
        return await self.client.text_document_completion_async(types.CompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri), position=types.Position(line=line, character=character)))

    async def stats(self) -> dict:
        return await self.client.workspace_execute_command_async(types.ExecuteCommandParams(command=STATS_COMMAND))

    async def status(self) -> dict:
        return await self.client.workspace_execute_command_async(types.ExecuteCommandParams(command=STATUS_COMMAND))


def first_text(result) -> Optional[str]:
    items = result.items if isinstance(result, types.InlineCompletionList) else (result or [])
    if not items:
        return None
    text = items[0].insert_text
    return text if isinstance(text, str) else text.value
