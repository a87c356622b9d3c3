"""The tokenizer of a Hugging Face model directory: encode, decode, chat templates, infill prompts.

Prompt text never turns into control tokens: ``encode`` splits text that looks like a special token
(``<|endoftext|>``, ``<|fim_prefix|>`` ...) into ordinary pieces unless the caller passes
``allow_special=True``. Control tokens are inserted by id (``build_infill``) or come from the model's
own chat template (``encode_chat``).

Two ``tokenizers.Tokenizer`` instances are kept, one per mode, so that no shared flag is toggled
while another thread encodes.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
import secrets
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from tokenizers import Tokenizer as HFTokenizer

from .errors import InvalidRequest, ModelLoadError

MAX_MESSAGES = 1024
MAX_MESSAGE_CHARS = 1 << 20
MAX_TEXT_CHARS = 1 << 23
MAX_PATH_CHARS = 4096
RENDER_SECONDS = 2.0    # a chat template still rendering after this long is stopped
RENDER_MAX_CHARS = 2 * MAX_TEXT_CHARS     # the most a chat template may write, or build in one value
TEXT_SLACK = 4          # margin over the longest token, for normalizers that drop characters

# Fill-in-the-middle control tokens: the Qwen-coder spelling first, then the StarCoder one.
_FIM_NAMES = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>"),
    "middle": ("<|fim_middle|>", "<fim_middle>"),
    "file_sep": ("<|file_sep|>", "<file_sep>"),
}
# Used as the end of text when neither config file names an EOS token.
_FALLBACK_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>")


def _read_json(path: Path, required: bool) -> Optional[dict]:
    if not path.exists():
        if required:
            raise ModelLoadError(f"{path}: file is missing")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_string(value: Any) -> Optional[str]:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


_CONTROL_SPELLING = re.compile(r"<[^\s<>]+>")


def _looks_like_control(content: str) -> bool:
    """An added token spelled like a control token (``<|fim_prefix|>``, ``<tool_call>``), whether or not
    tokenizer.json flags it special: some coder models leave their FIM tokens unflagged."""
    return bool(_CONTROL_SPELLING.fullmatch(content))


def _controls_marked_special(tokenizer_json: str) -> str:
    """tokenizer.json with every control-looking added token flagged special, for the text encoder, whose
    ``encode_special_tokens`` then splits their spellings like any other text. Other unflagged added
    tokens (runs of spaces in some code tokenizers) keep matching as the model was trained."""
    data = json.loads(tokenizer_json)
    changed = False
    for entry in data.get("added_tokens") or []:
        if isinstance(entry, dict) and not entry.get("special") and _looks_like_control(str(entry.get("content", ""))):
            entry["special"] = changed = True
    return json.dumps(data) if changed else tokenizer_json


def _as_id_list(value: Any, path: Path, key: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(f"{path}: {key} must be a non-negative integer or a list of them, got {value!r}")
    return list(ids)


class Tokenizer:
    """A model's tokenizer. Build it with ``Tokenizer.from_dir``."""

    def __init__(self, text_tok: HFTokenizer, special_tok: HFTokenizer, config: dict, gen_config: dict,
                 source: Path):
        text_tok.encode_special_tokens = True     # special-looking text splits like any other text
        special_tok.encode_special_tokens = False
        self._text = text_tok
        self._special = special_tok
        self._source = source
        # No token spells more than this many characters, so a text over ``limit_tokens`` of them times
        # TEXT_SLACK cannot fit and is refused before the work of tokenizing it (set by the engine).
        self._max_token_chars = max((len(t) for t in special_tok.get_vocab(with_added_tokens=True)), default=1)
        self.limit_tokens: Optional[int] = None
        self._special_ids = self._collect_special_ids(config)
        spellings = sorted(filter(None, (self._special.id_to_token(i) for i in self._special_ids)), key=len, reverse=True)
        # template text splits at these (longest first); the pieces between are text
        self._controls = re.compile("(" + "|".join(map(re.escape, spellings)) + ")") if spellings else None
        self._eos = self._collect_eos(config, gen_config)
        self._bos = self._find_bos(config, gen_config)
        self._add_bos, self._post_adds_bos = self._decide_add_bos(config)
        self._fim = {k: self._first_id(names) for k, names in _FIM_NAMES.items()}
        self._chat = ChatTemplate(
            self._template_source(config), source,
            bos_token=_token_string(config.get("bos_token")) or self._token_text(self._bos),
            eos_token=_token_string(config.get("eos_token")) or self._token_text(self._eos[0] if self._eos else None),
            special_tokens=spellings,
            chatml=self._special.token_to_id("<|im_start|>") is not None
            and self._special.token_to_id("<|im_end|>") is not None)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json (required), tokenizer_config.json and generation_config.json (optional)."""
        root = Path(path)
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelLoadError(f"{tok_path}: file is missing")
        try:
            text = tok_path.read_text(encoding="utf-8")
            toks = HFTokenizer.from_str(_controls_marked_special(text)), HFTokenizer.from_str(text)
        except Exception as e:  # the tokenizers library raises a bare Exception for bad files
            raise ModelLoadError(f"{tok_path}: not a valid tokenizer: {e}") from None
        config = _read_json(root / "tokenizer_config.json", required=False) or {}
        gen_config = _read_json(root / "generation_config.json", required=False) or {}
        return cls(toks[0], toks[1], config, gen_config, root)

    # ---- loading helpers -------------------------------------------------------------------
    def _collect_special_ids(self, config: dict) -> frozenset[int]:
        ids = {i for i, t in self._special.get_added_tokens_decoder().items() if t.special or _looks_like_control(t.content)}
        decoder = config.get("added_tokens_decoder") or {}
        cfg_path = self._source / "tokenizer_config.json"
        if not isinstance(decoder, dict):
            raise ModelLoadError(f"{cfg_path}: added_tokens_decoder must be an object")
        for key, entry in decoder.items():
            content = _token_string(entry)
            if not key.isdigit() or content is None:
                raise ModelLoadError(f"{cfg_path}: bad added_tokens_decoder entry {key!r}")
            actual = self._special.token_to_id(content)
            if actual is not None and actual != int(key):
                raise ModelLoadError(f"{cfg_path}: token {content!r} has id {key} but tokenizer.json says {actual}")
            if actual is not None and isinstance(entry, dict) and entry.get("special"):
                ids.add(actual)
        return frozenset(ids)

    def _collect_eos(self, config: dict, gen_config: dict) -> tuple[int, ...]:
        gen_path = self._source / "generation_config.json"
        ids = _as_id_list(gen_config.get("eos_token_id"), gen_path, "eos_token_id")
        name = _token_string(config.get("eos_token"))
        if name is not None:
            tid = self._special.token_to_id(name)
            if tid is None:
                raise ModelLoadError(f"{self._source / 'tokenizer_config.json'}: eos_token {name!r} is not in the vocabulary")
            ids.append(tid)
        if not ids:
            ids = [tid for n in _FALLBACK_EOS if (tid := self._special.token_to_id(n)) is not None][:1]
        return tuple(dict.fromkeys(ids))

    def _find_bos(self, config: dict, gen_config: dict) -> Optional[int]:
        gen_ids = _as_id_list(gen_config.get("bos_token_id"), self._source / "generation_config.json", "bos_token_id")
        if gen_ids:
            return gen_ids[0]
        name = _token_string(config.get("bos_token"))
        return None if name is None else self._special.token_to_id(name)

    def _decide_add_bos(self, config: dict) -> tuple[bool, bool]:
        """(whether encode adds BOS, whether the post-processor adds it). tokenizer_config's
        add_bos_token wins over the post-processor, in both directions."""
        if self._bos is None:
            return False, False
        probe = self._special.encode("a", add_special_tokens=True).ids
        post_adds = bool(probe) and probe[0] == self._bos
        wanted = config.get("add_bos_token")
        return (wanted if isinstance(wanted, bool) else post_adds), post_adds

    def _template_source(self, config: dict) -> Optional[str]:
        """tokenizer_config's chat_template (a string, or a list of named ones), else chat_template.jinja."""
        tpl = config.get("chat_template")
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default", next(iter(named.values()), None))
        if tpl is None and (self._source / "chat_template.jinja").is_file():
            try:
                tpl = (self._source / "chat_template.jinja").read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{self._source / 'chat_template.jinja'}: cannot read: {e}") from None
        if tpl is not None and not isinstance(tpl, str):
            raise ModelLoadError(f"{self._source / 'tokenizer_config.json'}: chat_template must be a string")
        return tpl

    def _first_id(self, names: Iterable[str]) -> Optional[int]:
        return next((tid for n in names if (tid := self._special.token_to_id(n)) is not None), None)

    def _token_text(self, tid: Optional[int]) -> str:
        return "" if tid is None else (self._special.id_to_token(tid) or "")

    # ---- properties ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._special.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def fim_prefix_id(self) -> Optional[int]:
        return self._fim["prefix"]

    @property
    def fim_suffix_id(self) -> Optional[int]:
        return self._fim["suffix"]

    @property
    def fim_middle_id(self) -> Optional[int]:
        return self._fim["middle"]

    @property
    def file_sep_id(self) -> Optional[int]:
        return self._fim["file_sep"]

    @property
    def has_chat_template(self) -> bool:
        return self._chat.source is not None

    def token_id(self, name: str) -> Optional[int]:
        """The id of a token spelled exactly ``name``, or None."""
        return self._special.token_to_id(name)

    # ---- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token spellings stay text unless ``allow_special``.

        ``add_special_tokens`` adds what the post-processor adds (BOS for most models); the
        add_bos_token of tokenizer_config.json, when set, decides about BOS.
        """
        if not isinstance(text, str):
            raise InvalidRequest(f"prompt must be a string, got {type(text).__name__}")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidRequest(f"text is longer than {MAX_TEXT_CHARS} characters")
        if self.limit_tokens and len(text) > self.limit_tokens * self._max_token_chars * TEXT_SLACK:
            raise InvalidRequest(f"a text of {len(text)} characters cannot fit the context window of "
                                 f"{self.limit_tokens} tokens; shorten it")
        tok = self._special if allow_special else self._text
        try:
            ids = tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:   # the tokenizers library refuses lone surrogates this way
            raise InvalidRequest("text is not valid Unicode (it holds a lone surrogate)") from None
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self._bos):
            ids.insert(0, self._bos)
        elif add_special_tokens and self._post_adds_bos and not self._add_bos:
            del ids[0]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._special.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- chat and infill -----------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's chat template (sandboxed) or the documented fallback."""
        return self._chat.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat: the template's control tokens by id, message contents as plain text.

        The text between two control tokens (template text and contents together) is encoded as one run,
        so a content's first word merges with the space or text before it as it would in the rendered
        string ("[INST] hello" gives " hello", not " " + "hello"). No BOS is added beyond what the
        template writes itself.
        """
        ids: list[int] = []
        run: list[str] = []

        def close_run():
            if run:
                ids.extend(self.encode("".join(run), add_special_tokens=False))
                run.clear()

        for text, is_content in self._chat.render_pieces(messages, add_generation_prompt):
            if is_content:
                run.append(text)
                continue
            for part in self._controls.split(text) if self._controls else [text]:
                control = self._special.token_to_id(part) if part else None
                if control is not None and control in self._special_ids:
                    close_run()
                    ids.append(control)
                elif part:
                    run.append(part)
        close_run()
        return ids

    def build_infill(self, prefix: str, suffix: str, extra_files: Iterable[tuple[str, str]] = ()) -> list[int]:
        """A fill-in-the-middle prompt in prefix-suffix-middle order::

            [BOS] (<file_sep> path \\n content \\n)* <fim_prefix> prefix <fim_suffix> suffix <fim_middle>

        User texts are encoded as text; control tokens are inserted by id. A newline is added after a
        file's content only when it does not end with one.
        """
        fim = self._fim
        if fim["prefix"] is None or fim["suffix"] is None or fim["middle"] is None:
            raise InvalidRequest("this model has no fill-in-the-middle tokens (<|fim_prefix|> ...)")
        files = list(extra_files)
        if files and fim["file_sep"] is None:
            raise InvalidRequest("this model has no <|file_sep|> token, so extra files cannot be given")
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            raise InvalidRequest("infill prefix and suffix must be strings")
        ids: list[int] = [self._bos] if self._add_bos else []
        for item in files:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(s, str) for s in item)):
                raise InvalidRequest("each extra file must be a (path, content) pair of strings")
            path, content = item
            if len(path) > MAX_PATH_CHARS or "\n" in path:
                raise InvalidRequest(f"file path must be one line of at most {MAX_PATH_CHARS} characters")
            body = content if content.endswith("\n") or not content else content + "\n"
            ids += [fim["file_sep"]] + self._plain(f"{path}\n{body}")
        ids += [fim["prefix"]] + self._plain(prefix) + [fim["suffix"]] + self._plain(suffix) + [fim["middle"]]
        return ids

    def _plain(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False, allow_special=False)


# Used when the model has no chat template. ChatML when the vocabulary has its control tokens,
# otherwise "role: content" paragraphs ending with "assistant:".
_FALLBACK_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_FALLBACK_PLAIN = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


class _RenderLimit(Exception):
    """A rendering ran past RENDER_SECONDS or RENDER_MAX_CHARS characters."""


# The deadline of the rendering in progress on this thread (None: not rendering).
_DEADLINE: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("llmd_render_deadline", default=None)


@contextlib.contextmanager
def _render_deadline():
    """Renderings inside share one deadline: the outermost sets it (a chat's two renderings get one)."""
    token = _DEADLINE.set(_DEADLINE.get() or time.monotonic() + RENDER_SECONDS)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _check_deadline() -> None:
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() > deadline:
        raise _RenderLimit(f"the chat template took longer than {RENDER_SECONDS:g} s to render")


def _check_size(n: int) -> None:
    """A value the template builds may not exceed what it may write."""
    if n > RENDER_MAX_CHARS:
        raise _RenderLimit("the chat template built a value longer than the output bound")


def _checked(items: Iterable) -> Iterable:
    """Iterates ``items``, checking the render deadline every 256 items."""
    for i, item in enumerate(items):
        if not i & 255:
            _check_deadline()
        yield item


def _concat(*parts: Any) -> str:
    """The template's ``~`` operator, refusing a result longer than the output bound."""
    strings = [str(p) for p in parts]
    _check_size(sum(map(len, strings)))
    return "".join(strings)


_NUMBER = re.compile(r"\d+")


def _check_args(args: Iterable, fmt: Any = None) -> None:
    """Before a call that may allocate in proportion to its arguments (``center(10**9)``,
    ``'%1000000000s'|format(x)``, ``'{:>1000000000}'.format(x)``): no integer argument, and no number in
    a format string, may exceed the output bound."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > RENDER_MAX_CHARS:
            raise _RenderLimit(f"the chat template asked for a size of {a}, more than the output bound")
    if isinstance(fmt, str) and any(len(n) > 7 and int(n) > RENDER_MAX_CHARS for n in _NUMBER.findall(fmt)):
        raise _RenderLimit("the chat template's format string asks for a width larger than the output bound")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    """``replace`` grows its text by (len(new) - len(old)) per occurrence: checked before it runs."""
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        grows = (len(text) + 1) * len(new) if not old else text.count(old) * (len(new) - len(old))
        _check_size(len(text) + grows)


def _check_result(out: Any) -> Any:
    if isinstance(out, (str, list, tuple)):
        _check_size(len(out))
    return out


_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)   # what jinja passes filters first


def _bounded_filter(name: str, fn):
    """A filter with the checks of a call: sizes and format widths before, the result's length after."""
    @functools.wraps(fn)       # keeps jinja's pass_context / pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        values = [a for a in args if not isinstance(a, _PASSED)]      # the value, then the template's arguments
        _check_args([*values, *kwargs.values()], values[0] if name == "format" and values else None)
        if name == "replace" and len(values) >= 3:
            _check_replace(str(values[0]), values[1], values[2])
        return _check_result(fn(*args, **kwargs))
    return run


class _Bounded(NodeTransformer):
    """Rewrites a parsed template so that every ``for`` loop iterates through ``_checked`` (the deadline
    then holds whatever the loop runs over: messages, slices, filters' results, range) and every ``~``
    goes through ``_concat``."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("llmd_checked"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("llmd_concat"), list(node.nodes), [], None, None,
                          lineno=node.lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, failing loudly (not with an empty string) on unsafe attributes, with
    bounds for a template from an untrusted model directory: every loop iteration (checked every 256
    items), attribute or item access and call checks the render deadline, and ``*``, ``+`` and ``~``
    refuse to build a string or list longer than the output bound. Calls and filters (``center``,
    ``format``, ``replace``, ...) are refused before they run when an integer argument or a format width
    exceeds that bound, or a replacement would; their results are held to it after. Against runaway
    templates, not a memory sandbox: a filter can still build a value up to the bound before it is
    refused."""

    intercepted_binops = frozenset({"*", "+", "%"})
    llmd_checked = staticmethod(_checked)
    llmd_concat = staticmethod(_concat)

    def _parse(self, source: str, name: Optional[str], filename: Optional[str]) -> nodes.Template:
        return _Bounded().visit(super()._parse(source, name, filename))

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's own naming: a template may pass self=)
        _check_deadline()
        bound = getattr(__obj, "__self__", None)            # a str method: 'x'.center(n), '{}'.format(...)
        name = getattr(__obj, "__name__", "")
        _check_args([*args, *kwargs.values()], bound if isinstance(bound, str) and "format" in name else None)
        if isinstance(bound, str) and name == "replace" and len(args) >= 2:
            _check_replace(bound, args[0], args[1])
        return _check_result(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        sized = (str, list, tuple)
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, sized) and isinstance(times, int):
                _check_size(len(seq) * times)         # before the value exists
        elif operator == "%" and isinstance(left, str):
            _check_args(right if isinstance(right, tuple) else [right], left)
        out = super().call_binop(context, operator, left, right)
        if operator in "+%" and isinstance(out, sized):
            _check_size(len(out))
        return out


def _raise_exception(message: str):
    raise TemplateError(str(message))


def _tojson(value: Any, indent: Optional[int] = None, **_ignored) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A compiled chat template. Rendering errors and refusals raise InvalidRequest."""

    def __init__(self, source: Optional[str], model_dir: Path, bos_token: str, eos_token: str,
                 special_tokens: list[str], chatml: bool):
        self.source = source
        self._specials = [t for t in special_tokens if t]
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
        env.globals.update(raise_exception=_raise_exception, bos_token=bos_token, eos_token=eos_token,
                           strftime_now=lambda fmt: time.strftime(fmt))
        self._compile_error: Optional[str] = None
        try:
            self._template = env.from_string(source or (_FALLBACK_CHATML if chatml else _FALLBACK_PLAIN))
        except TemplateError as e:
            # A broken template fails chat requests, not the whole model: completions still work.
            self._template = None
            self._compile_error = f"the chat template in {model_dir} does not compile: {e}"

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._render(_validate_messages(messages), add_generation_prompt)

    def render_pieces(self, messages: list[dict], add_generation_prompt: bool) -> list[tuple[str, bool]]:
        """The rendering as (text, is_message_content) pieces.

        Renders twice: with the real contents and with a unique marker in place of each content. When
        putting the contents (as they are, or stripped) back at the markers reproduces the real
        rendering exactly, the pieces are known. Otherwise the template transforms contents; then contents that spell a special
        token are refused, since they could not be kept as text.
        """
        msgs = _validate_messages(messages)
        nonce = secrets.token_hex(8)
        marks = [f"[[llmd-{nonce}-{i}]]" for i in range(len(msgs))]   # no whitespace: survives strip()
        with _render_deadline():
            real = self._render(msgs, add_generation_prompt)
            marked = self._render([{**m, "content": k} for m, k in zip(msgs, marks)], add_generation_prompt)
        for transform in (str, str.strip):     # templates commonly strip message contents
            pieces = _split_at_marks(marked, marks, [transform(m["content"]) for m in msgs])
            if pieces is not None and "".join(t for t, _ in pieces) == real:
                return pieces
        bad = [t for t in self._specials for m in msgs if t in m["content"]]
        if bad:
            raise InvalidRequest(f"message content contains the special token {bad[0]!r}, which this chat "
                                 "template would turn into a control token")
        return [(real, False)]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self._template is None:
            raise InvalidRequest(self._compile_error)
        try:
            with _render_deadline():
                out = self._bounded(messages, bool(add_generation_prompt))
        except _RenderLimit as e:
            raise InvalidRequest(str(e)) from None
        except SecurityError as e:
            raise InvalidRequest(f"the chat template did something unsafe and was stopped: {e}") from None
        except TemplateError as e:
            raise InvalidRequest(f"the chat template rejected the messages: {e}") from None
        except Exception as e:  # template code can raise anything (TypeError on bad data ...)
            raise InvalidRequest(f"the chat template failed: {type(e).__name__}: {e}") from None
        return out

    def _bounded(self, messages: list, add_generation_prompt: bool) -> str:
        """The rendering, stopped once it runs past RENDER_MAX_CHARS characters or the deadline."""
        parts, size = [], 0
        for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt):
            size += len(chunk)
            if size > RENDER_MAX_CHARS:
                raise _RenderLimit("the rendered chat is too long")
            _check_deadline()
            parts.append(chunk)
        return "".join(parts)


def _split_at_marks(marked: str, marks: list[str], contents: list[str]) -> Optional[list[tuple[str, bool]]]:
    """Split ``marked`` at each mark (each must appear exactly once, in order), contents in between."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for mark, content in zip(marks, contents):
        at = marked.find(mark, pos)
        if at < 0 or marked.count(mark) != 1:
            return None
        pieces += [(marked[pos:at], False), (content, True)]
        pos = at + len(mark)
    pieces.append((marked[pos:], False))
    return [p for p in pieces if p[0]]


def _validate_messages(messages: Any) -> list[dict]:
    """Messages as fresh {"role", "content"} dicts of bounded strings."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not 0 < len(role) <= 64:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string of at most 64 characters")
        if not isinstance(content, str) or len(content) > MAX_MESSAGE_CHARS:
            raise InvalidRequest(f"messages[{i}].content must be a string of at most {MAX_MESSAGE_CHARS} characters")
        total += len(content)
        out.append({"role": role, "content": content})
    if total > MAX_TEXT_CHARS:
        raise InvalidRequest(f"messages hold more than {MAX_TEXT_CHARS} characters in all")
    return out
