"""``llmd lsp``: a language server that suggests code from the llmd daemon.

Serves ``textDocument/inlineCompletion`` (LSP 3.18: ghost text) and ``textDocument/completion``
(one item holding the same suggestion) for clients without inline completion. Documents are
tracked by pygls from didOpen/didChange, and each also sends the document's prompt ahead as a
prompt-only request (``CompletionService.opened`` / ``edited``); the completion logic is in ``lsp_service``. The
command ``llmd.stats`` (workspace/executeCommand) answers outcome counts and latency
percentiles; ``llmd.status`` the backend and which of its features are off. Speaks LSP over
stdio; logs go to stderr or ``--log-file``.
"""
from __future__ import annotations

import logging
from typing import Optional

from lsprotocol import types
from pygls.lsp.server import LanguageServer

from llmd import __version__

from .backend import backend_of
from .http_backend import is_http
from .lsp_prompt import FimBudget, display_path
from .lsp_service import CompletionService, LspConfig

STATS_COMMAND = "llmd.stats"
STATUS_COMMAND = "llmd.status"          # the backend, and which protocol features it serves


def other_documents(server: LanguageServer, uri: str) -> list[tuple[str, str]]:
    """(path, text) of the other open documents, the most recently opened first."""
    docs = [d for u, d in server.workspace.text_documents.items() if u != uri]
    return [(display_path(d.uri), d.source) for d in reversed(docs)]


async def suggest(server: LanguageServer, service: CompletionService, uri: str,
                  position: types.Position) -> Optional[str]:
    doc = server.workspace.get_text_document(uri)
    text = doc.source
    offset = min(doc.offset_at_position(position), len(text))
    return await service.complete(uri, text, offset, other_documents(server, uri))


def build_server(config: LspConfig, service: Optional[CompletionService] = None) -> LanguageServer:
    server = LanguageServer("llmd", __version__)
    service = service or CompletionService(config)

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: LanguageServer, params: types.InlineCompletionParams):
        text = await suggest(ls, service, params.text_document.uri, params.position)
        if not text:
            return types.InlineCompletionList(items=[])
        at = types.Range(start=params.position, end=params.position)
        return types.InlineCompletionList(items=[types.InlineCompletionItem(insert_text=text, range=at)])

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(trigger_characters=[".", "(", " "]))
    async def completion(ls: LanguageServer, params: types.CompletionParams):
        text = await suggest(ls, service, params.text_document.uri, params.position)
        if not text:
            return types.CompletionList(is_incomplete=True, items=[])
        at = types.Range(start=params.position, end=params.position)
        item = types.CompletionItem(label=text.split("\n", 1)[0].strip() or text.strip(),
                                    kind=types.CompletionItemKind.Snippet, detail="llmd",
                                    text_edit=types.TextEdit(range=at, new_text=text),
                                    insert_text_format=types.InsertTextFormat.PlainText)
        return types.CompletionList(is_incomplete=True, items=[item])

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: LanguageServer, params: types.DidOpenTextDocumentParams):
        uri = params.text_document.uri
        service.opened(uri, ls.workspace.get_text_document(uri).source, other_documents(ls, uri))

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: LanguageServer, params: types.DidChangeTextDocumentParams):
        uri = params.text_document.uri
        doc = ls.workspace.get_text_document(uri)
        last = params.content_changes[-1] if params.content_changes else None
        if last is None or getattr(last, "range", None) is None:
            return                    # a whole-document replacement says nothing about the cursor
        # the cursor after an edit: the end of the text the last change inserted
        offset = min(doc.offset_at_position(last.range.start) + len(last.text), len(doc.source))
        service.edited(uri, doc.source, offset, other_documents(ls, uri))

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: LanguageServer, params: types.DidCloseTextDocumentParams):
        service.forget(params.text_document.uri)

    @server.command(STATS_COMMAND)
    def stats(ls: LanguageServer, *args):
        return service.stats.snapshot()

    @server.command(STATUS_COMMAND)
    def status(ls: LanguageServer, *args):
        return service.backend_status()

    @server.feature(types.SHUTDOWN)
    async def shutdown(ls: LanguageServer, *args):
        await service.aclose()

    return server


def config_from_args(args) -> LspConfig:
    budget = FimBudget(prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                       context_tokens=args.context_tokens, chars_per_token=args.chars_per_token)
    backend = backend_of(args)
    # prompt-only requests are llmd's own: over an HTTP backend, typing prefills nothing
    return LspConfig(socket=backend, budget=budget, max_tokens=args.max_tokens, max_lines=args.max_lines,
                     debounce_ms=args.debounce_ms, cache_size=args.cache_size,
                     prefill=not args.no_prefill and not is_http(backend), target_ms=args.target_ms,
                     layout=args.fim_layout, timeout_s=args.timeout, shift_reuse=args.shift_reuse,
                     split=args.fim_split)


def run_lsp(args) -> int:
    import sys
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"llmd lsp: {e}", file=sys.stderr)
        return 2
    handler = logging.FileHandler(args.log_file) if args.log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("llmd.lsp").addHandler(handler)
    logging.getLogger("llmd.lsp").setLevel(args.log_level.upper())
    build_server(config).start_io()
    return 0
