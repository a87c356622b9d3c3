"""The jinja sandbox chat templates run in, with time and size bounds.

A chat template is a program shipped in a model directory. Jinja's immutable sandbox stops it from
touching Python internals; the bounds here stop it from running forever or filling memory:

- every loop iterates through ``_checked`` (the render deadline, checked every 256 items), and every
  attribute or item access, call and filter checks the deadline;
- ``*``, ``+``, ``~`` and ``%`` refuse to build a string or list longer than ``RENDER_MAX_CHARS``;
- a call or filter that grows its result from its arguments (``center``, ``indent``, ``format``,
  ``replace``, ``join``, ``expandtabs``, ``wordwrap``, ``slice``, ``batch``, ``tojson``, ``**``) is
  refused *before* it runs when the result it may build exceeds the bound; every call's and filter's
  string or list result is held to the bound after.

The checks are against runaway or hostile templates, not a memory sandbox: a value up to the bound may
be built before it is refused.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
import string
import time
from typing import Any, Iterable, Optional

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 2.0          # a chat template still rendering after this long is stopped
RENDER_MAX_CHARS = 1 << 24    # the most a template may write, or build in one value: twice the text one
                              # request may carry (tokenizer.MAX_TEXT_CHARS), so wrapping it always fits
MAX_TOJSON_INDENT = 64
MAX_BIG_INT_BITS = 1 << 20    # ``**`` may not build an integer wider than this
LIST_ITEM_CHARS = 64          # what one list a filter builds counts against the bound


class RenderLimit(Exception):
    """A rendering ran past RENDER_SECONDS, or would build more than RENDER_MAX_CHARS characters."""


# The deadline of the rendering in progress on this thread (None: not rendering).
_DEADLINE: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("llmd_render_deadline", default=None)


@contextlib.contextmanager
def render_deadline():
    """Renderings inside share one deadline: the outermost sets it (a chat's two renderings get one)."""
    token = _DEADLINE.set(_DEADLINE.get() or time.monotonic() + RENDER_SECONDS)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def check_deadline() -> None:
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() > deadline:
        raise RenderLimit(f"the chat template took longer than {RENDER_SECONDS:g} s to render")


def _check_size(n: int, what: str = "built a value") -> None:
    if n > RENDER_MAX_CHARS:
        raise RenderLimit(f"the chat template {what} longer than the output bound ({RENDER_MAX_CHARS} characters)")


def _checked(items: Iterable) -> Iterable:
    """Iterates ``items``, checking the render deadline every 256 items."""
    for i, item in enumerate(items):
        if not i & 255:
            check_deadline()
        yield item


def _concat(*parts: Any) -> str:
    """The template's ``~`` operator, refusing a result longer than the output bound."""
    strings = [str(p) for p in parts]
    _check_size(sum(map(len, strings)))
    return "".join(strings)


def _size_of(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else len(str(x))


def _int(x: Any, default: int = 0) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else default


# -- the most a format string can write ------------------------------------------------------------
_PRINTF = re.compile(r"%(\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d+))?[a-zA-Z%]?\Z", re.S)


def _printf_bound(fmt: str, args: Any) -> int:
    """Characters ``fmt % args`` may write at most: the literal text, each field's width and precision,
    and the longest argument once per field (``*`` widths count the largest integer argument)."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    longest = max((_size_of(v) for v in values), default=0)
    widest = max((abs(_int(v)) for v in values), default=0)
    total = len(fmt)
    for m in _PRINTF.finditer(fmt):
        width, precision = m.group(2), m.group(3)
        total += sum(widest if p == "*" else int(p) for p in (width, precision) if p) + longest
    return total


def _format_bound(fmt: str, args: Iterable, kwargs: dict) -> int:
    """The same for ``fmt.format(*args, **kwargs)`` (and ``format_map``); a width or precision taken
    from an argument (a nested ``{}`` in a spec) counts as unbounded."""
    values = [*args, *kwargs.values()]
    values += [v for a in values if isinstance(a, dict) for v in a.values()]      # format_map's mapping
    longest = max((_size_of(v) for v in values), default=0)
    total = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)           # malformed: str.format raises before it builds anything
    for literal, field, spec, _conversion in fields:
        total += len(literal)
        if field is None:
            continue
        if spec and "{" in spec:
            return RENDER_MAX_CHARS + 1
        m = _SPEC.match(spec or "")
        digits = [g for g in m.groups() if g] if m else re.findall(r"\d+", spec or "")
        total += sum(int(d) for d in digits) + longest
    return total


# -- calls and filters that grow their result from their arguments ---------------------------------
def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _lines(s: str) -> int:
    return s.count("\n") + 1


def _indent_bound(text: str, width: Any) -> int:
    """``indent`` puts ``width`` (spaces, or a string) before each line."""
    return len(text) + _lines(text) * (len(width) if isinstance(width, str) else max(0, _int(width)))


def _replace_bound(text: Any, args: tuple, kwargs: dict) -> int:
    old, new, count = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"), _arg(args, kwargs, 2, "count")
    text = str(text)
    if not isinstance(old, str) or not isinstance(new, str):
        return 0
    hits = len(text) + 1 if not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def _width_bound(s: str, args: tuple, kwargs: dict) -> int:
    """``center``, ``ljust``, ``rjust``, ``zfill``: the string padded to ``width``."""
    return max(len(s), _int(_arg(args, kwargs, 0, "width")))


def _wordwrap_bound(text: Any, args: tuple, kwargs: dict) -> int:
    """``wordwrap`` may put ``wrapstring`` after every ``width`` characters."""
    width = max(1, _int(_arg(args, kwargs, 0, "width", 79), 1))
    wrap = _arg(args, kwargs, 2, "wrapstring", "\n") or "\n"
    return _size_of(text) + (_size_of(text) // width + 1) * _size_of(wrap)


def _join_bound(sep: Any, items: Any) -> int:
    if not isinstance(items, (list, tuple, str, dict)):
        return 0                  # an iterator: held to the bound after
    return len(str(sep)) * max(0, len(items) - 1) + sum(_size_of(x) for x in items)


_METHOD_BOUNDS = {   # str method -> the most it may build, from (the string, args, kwargs)
    "center": _width_bound, "ljust": _width_bound, "rjust": _width_bound, "zfill": _width_bound,
    "expandtabs": lambda s, a, k: len(s) + s.count("\t") * max(0, _int(_arg(a, k, 0, "tabsize", 8))),
    "replace": _replace_bound,
    "join": lambda s, a, k: _join_bound(s, _arg(a, k, 0, "iterable")),
    "format": _format_bound,
    "format_map": _format_bound,
}

_FILTER_BOUNDS = {   # filter -> the most it may build, from (the value, args, kwargs)
    "center": lambda v, a, k: max(_size_of(v), _int(_arg(a, k, 0, "width", 80))),
    "indent": lambda v, a, k: _indent_bound(str(v), _arg(a, k, 0, "width", 4)),
    "format": lambda v, a, k: _printf_bound(str(v), k if k else tuple(a)),
    "replace": _replace_bound,
    "join": lambda v, a, k: _join_bound(_arg(a, k, 0, "d", ""), v),
    "wordwrap": _wordwrap_bound,
    # lists count their items at LIST_ITEM_CHARS each: [1]|slice(10**7) builds ten million lists
    "slice": lambda v, a, k: _int(_arg(a, k, 0, "slices")) * LIST_ITEM_CHARS,
    "batch": lambda v, a, k: _int(_arg(a, k, 0, "linecount")) * LIST_ITEM_CHARS
    if _arg(a, k, 1, "fill_with") is not None else 0,
}

_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)   # what jinja passes filters first


def _check_result(out: Any) -> Any:
    if isinstance(out, (str, list, tuple)):
        _check_size(len(out))
    return out


def _bounded_filter(name: str, fn):
    """A filter with the checks of a call: what it may build before, its result's length after."""
    bound = _FILTER_BOUNDS.get(name)

    @functools.wraps(fn)       # keeps jinja's pass_context / pass_eval_context / pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        check_deadline()
        values = [a for a in args if not isinstance(a, _PASSED)]    # the value, then the template's arguments
        if bound is not None and values:
            _check_size(bound(values[0], tuple(values[1:]), kwargs), f"asked the {name} filter for a value")
        return _check_result(fn(*args, **kwargs))
    return run


def _tojson(value: Any, indent: Optional[int] = None, **_ignored) -> str:
    if isinstance(indent, int) and not 0 <= indent <= MAX_TOJSON_INDENT:
        raise RenderLimit(f"the chat template asked tojson for an indent of {indent} (at most {MAX_TOJSON_INDENT})")
    return json.dumps(value, ensure_ascii=False, indent=indent)


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


class Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, failing loudly (not with an empty string) on unsafe attributes, with
    the bounds of this module."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    llmd_checked = staticmethod(_checked)
    llmd_concat = staticmethod(_concat)

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.globals.pop("lipsum", None)     # lorem ipsum of any length: no chat template needs it

    def _parse(self, source: str, name: Optional[str], filename: Optional[str]) -> nodes.Template:
        return _Bounded().visit(super()._parse(source, name, filename))

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def getattr(self, obj: Any, attribute: str) -> Any:
        check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        check_deadline()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's own naming: a template may pass self=)
        check_deadline()
        method = getattr(__obj, "__wrapped__", __obj)       # the sandbox wraps str.format when it is looked up
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str) and name in _METHOD_BOUNDS:
            _check_size(_METHOD_BOUNDS[name](owner, args, kwargs), f"asked str.{name} for a value")
        return _check_result(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_deadline()
        sized = (str, list, tuple)
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, sized) and isinstance(times, int):
                _check_size(len(seq) * times)         # before the value exists
        elif operator == "%" and isinstance(left, str):
            _check_size(_printf_bound(left, right), "asked a % format for a value")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * abs(left).bit_length() > MAX_BIG_INT_BITS:
                raise RenderLimit("the chat template raised a number to a power too large to compute")
        out = super().call_binop(context, operator, left, right)
        if operator in ("+", "%") and isinstance(out, sized):
            _check_size(len(out))
        return out
