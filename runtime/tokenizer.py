"""The tokenizer of a Hugging Face model directory: encode, decode, chat templates, infill prompts.

Prompt text never turns into control tokens: ``encode`` splits text that looks like a special token
(``<|endoftext|>``, ``<|fim_prefix|>`` ...) into ordinary pieces unless the caller passes
``allow_special=True``. Control tokens are inserted by id (``build_infill``) or come from the model's
own chat template (``encode_chat``). One exception, for completion prompts that editors write in the
model's fill-in-the-middle format: ``encode_fim_markers`` turns the model's FIM markers written in the
text (and those alone) into its FIM tokens.

Two ``tokenizers.Tokenizer`` instances are kept, one per mode, so that no shared flag is toggled
while another thread encodes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import MAX_TEXT_CHARS, ChatTemplate
from .errors import InvalidRequest, ModelLoadError
from .fim import FimTokens, Part, find_fim, layout as fim_layout, marker_pattern, split_markers

if TYPE_CHECKING:
    from .models.config import ModelConfig

FIM_LAYOUTS = ("psm", "spm")    # fill-in-the-middle orders: prefix-suffix-middle, suffix-prefix-middle
MAX_PATH_CHARS = 4096
TEXT_SLACK = 4          # margin over the longest token, for normalizers that drop characters

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


def _controls_marked_special(tokenizer_json: str, loaded: HFTokenizer) -> str:
    """tokenizer.json with every control-looking added token flagged special, for the text encoder, whose
    ``encode_special_tokens`` then splits their spellings like any other text. Other unflagged added
    tokens (runs of spaces in some code tokenizers) keep matching as the model was trained. ``loaded``
    is the same file, loaded: where it flags every such token already, the text is returned unparsed."""
    if not any(not t.special and _looks_like_control(t.content) for t in loaded.get_added_tokens_decoder().values()):
        return tokenizer_json
    # only the top-level "added_tokens" array is read and rewritten (a quoted key cannot occur inside a
    # JSON string unescaped), not the whole vocabulary; the whole file where that array is not found
    key = tokenizer_json.find('"added_tokens":')
    if key >= 0:
        start = key + len('"added_tokens":')
        while tokenizer_json[start:start + 1].isspace():
            start += 1
        entries, end = json.JSONDecoder().raw_decode(tokenizer_json, start)
        if isinstance(entries, list) and _flag_controls(entries):
            return tokenizer_json[:start] + json.dumps(entries) + tokenizer_json[end:]
        return tokenizer_json
    data = json.loads(tokenizer_json)
    return json.dumps(data) if _flag_controls(data.get("added_tokens") or []) else tokenizer_json


def _flag_controls(entries: list) -> bool:
    """Flag the control-looking unflagged entries of an added_tokens list special; whether any was."""
    changed = False
    for entry in entries:
        if isinstance(entry, dict) and not entry.get("special") and _looks_like_control(str(entry.get("content", ""))):
            entry["special"] = changed = True
    return changed


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
        self._fim: FimTokens = find_fim(config, self._special.token_to_id, self._special.id_to_token, self._special_ids,
                                        self.vocab_size, str(source / "tokenizer_config.json"))
        self._fim_markers = marker_pattern(self._fim, self._special.id_to_token)
        self._joined = _without_space_prefix(text_tok) or text_tok
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
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{tok_path}: cannot read: {e}") from None
        config = _read_json(root / "tokenizer_config.json", required=False) or {}
        gen_config = _read_json(root / "generation_config.json", required=False) or {}
        return cls._build(text, config, gen_config, root, tok_path)

    @classmethod
    def from_texts(cls, files: dict[str, str], source: str | Path) -> "Tokenizer":
        """The tokenizer of a model file that carries its own (a GGUF file): ``files`` maps
        tokenizer.json, tokenizer_config.json and generation_config.json to their JSON text."""
        source = Path(source)
        try:
            config = json.loads(files.get("tokenizer_config.json") or "{}")
            gen_config = json.loads(files.get("generation_config.json") or "{}")
        except ValueError as e:
            raise ModelLoadError(f"{source}: tokenizer metadata is not valid JSON: {e}") from None
        return cls._build(files["tokenizer.json"], config, gen_config, source, source)

    @classmethod
    def _build(cls, text: str, config: dict, gen_config: dict, root: Path, where: Path) -> "Tokenizer":
        try:
            special = HFTokenizer.from_str(text)
            marked = _controls_marked_special(text, special)
            toks = HFTokenizer.from_str(marked), special
        except Exception as e:  # the tokenizers library raises a bare Exception for bad files
            raise ModelLoadError(f"{where}: not a valid tokenizer: {e}") from None
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
        for key in ("eos_token", "eot_token"):      # eot_token: where an infill ends (CodeLlama's "▁<EOT>")
            name = _token_string(config.get(key))
            if name is not None:
                tid = self._special.token_to_id(name)
                if tid is None:
                    raise ModelLoadError(f"{self._source / 'tokenizer_config.json'}: {key} {name!r} is not in the "
                                         "vocabulary")
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
    def fim(self) -> FimTokens:
        return self._fim

    @property
    def can_infill(self) -> bool:
        return self._fim.can_infill

    @property
    def fim_prefix_id(self) -> Optional[int]:
        return self._fim.prefix

    @property
    def fim_suffix_id(self) -> Optional[int]:
        return self._fim.suffix

    @property
    def fim_middle_id(self) -> Optional[int]:
        return self._fim.middle

    @property
    def file_sep_id(self) -> Optional[int]:
        return self._fim.file_sep

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
        self._check_text(text)
        ids = self._run(self._special if allow_special else self._text, text, add_special_tokens)
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self._bos):
            ids.insert(0, self._bos)
        elif add_special_tokens and self._post_adds_bos and not self._add_bos:
            del ids[0]
        return ids

    def _check_text(self, text: str) -> None:
        if not isinstance(text, str):
            raise InvalidRequest(f"prompt must be a string, got {type(text).__name__}")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidRequest(f"text is longer than {MAX_TEXT_CHARS} characters")
        if self.limit_tokens and len(text) > self.limit_tokens * self._max_token_chars * TEXT_SLACK:
            raise InvalidRequest(f"a text of {len(text)} characters cannot fit the context window of "
                                 f"{self.limit_tokens} tokens; shorten it")

    @staticmethod
    def _run(tok: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:   # the tokenizers library refuses lone surrogates this way
            raise InvalidRequest("text is not valid Unicode (it holds a lone surrogate)") from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._special.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- chat and infill -----------------------------------------------------------------
    def to_json(self) -> str:
        """The tokenizers library's JSON of this tokenizer (for runtime.grammar)."""
        return self._special.to_str()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> str:
        """Render messages with the model's chat template (sandboxed) or the documented fallback."""
        return self._chat.render(messages, add_generation_prompt, tools)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None) -> list[int]:
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

        for text, is_content in self._chat.render_pieces(messages, add_generation_prompt, tools):
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

    def build_infill(self, prefix: str, suffix: str, extra_files: Iterable[tuple[str, str]] = (),
                     layout: str = "psm", middle: str = "") -> list[int]:
        """A fill-in-the-middle prompt, in prefix-suffix-middle order (``psm``)::

            [BOS] (<file_sep> path \\n content \\n)* <fim_prefix> prefix <fim_suffix> suffix <fim_middle>

        or suffix-prefix-middle (``spm``), where the text the user types at the cursor comes last, so
        a prompt after a keystroke shares all but its last few tokens with the one before::

            [BOS] (<file_sep> path \\n content \\n)* <fim_suffix> suffix <fim_prefix> prefix <fim_middle>

        ``middle`` is the start of the middle, already written (the part of the cursor's line before
        it): it follows ``<fim_middle>`` and the model continues it, so a prompt whose prefix ends at
        the line's start stays the same up to there while the user types on that line.

        Those are the orders of the Qwen, StarCoder and DeepSeek-Coder families; CodeLlama's and
        Codestral's differ (runtime/fim.py). User texts are encoded as text; control tokens are inserted
        by id. A newline is added after a file's content only when it does not end with one.
        """
        fim = self._fim
        if not fim.can_infill:
            raise InvalidRequest("this model has no fill-in-the-middle tokens: its file names none "
                                 "(tokenizer.ggml.fim_pre_token_id ...) and none of its special tokens is spelled "
                                 "as Qwen, StarCoder, DeepSeek-Coder, CodeLlama or Codestral spell them")
        files = list(extra_files)
        if files and fim.file_sep is None:
            raise InvalidRequest("this model has no file separator token (<|file_sep|>), so extra files cannot be "
                                 "given")
        if not isinstance(prefix, str) or not isinstance(suffix, str) or not isinstance(middle, str):
            raise InvalidRequest("infill prefix, suffix and middle must be strings")
        if layout not in FIM_LAYOUTS:
            raise InvalidRequest(f"infill layout must be one of {', '.join(FIM_LAYOUTS)}, got {layout!r}")
        ids: list[int] = [self._bos] if self._add_bos else []
        for item in files:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(s, str) for s in item)):
                raise InvalidRequest("each extra file must be a (path, content) pair of strings")
            path, content = item
            if len(path) > MAX_PATH_CHARS or "\n" in path:
                raise InvalidRequest(f"file path must be one line of at most {MAX_PATH_CHARS} characters")
            body = content if content.endswith("\n") or not content else content + "\n"
            ids += [fim.file_sep] + self._plain(f"{path}\n{body}")
        return ids + self._encode_parts(fim_layout(fim, prefix, suffix, middle, layout))

    def encode_fim_markers(self, text: str) -> Optional[list[int]]:
        """Token ids of a completion prompt that writes the model's FIM markers as text (``<|fim_prefix|>``
        ... as editors send them): each marker becomes its token, the rest is text, as ``build_infill``
        encodes it. None when the text writes none of them (then it is ordinary text). No other special
        token is read from text."""
        if self._fim_markers is None:
            return None
        self._check_text(text)
        parts = split_markers(text, self._fim, self._fim_markers, self._special.token_to_id)
        if parts is None:
            return None
        return ([self._bos] if self._add_bos else []) + self._encode_parts(parts)

    def _encode_parts(self, parts: list[Part]) -> list[int]:
        ids: list[int] = []
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
            elif part[1]:
                self._check_text(part[0])
                ids += self._run(self._joined, part[0], False)
            elif part[0]:
                ids += self._plain(part[0])
        return ids

    def _plain(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False, allow_special=False)


def _without_space_prefix(tok: HFTokenizer) -> Optional[HFTokenizer]:
    """A copy of a SentencePiece-style tokenizer that puts no "▁" before the text (for text that continues
    what is before it), or None where the tokenizer puts none."""
    parts = [part.__getstate__() for part in (tok.normalizer, tok.pre_tokenizer) if part is not None]
    if not any(b'"Prepend"' in state or b'"Metaspace"' in state for state in parts):
        return None                 # neither puts a prefix: the whole file need not be read again
    data = json.loads(tok.to_str())
    changed = False

    def strip(node: Optional[dict], kind: str) -> Optional[dict]:
        nonlocal changed
        if not isinstance(node, dict):
            return node
        if node.get("type") == "Sequence":
            key = "normalizers" if kind == "normalizer" else "pretokenizers"
            node[key] = [n for n in (strip(n, kind) for n in node.get(key) or []) if n is not None]
            return node
        if kind == "normalizer" and node.get("type") == "Prepend":
            changed = True
            return None
        if kind == "pre_tokenizer" and node.get("type") == "Metaspace" and node.get("prepend_scheme") != "never":
            changed = True
            node["prepend_scheme"] = "never"
        return node

    data["normalizer"] = strip(data.get("normalizer"), "normalizer")
    data["pre_tokenizer"] = strip(data.get("pre_tokenizer"), "pre_tokenizer")
    if not changed:
        return None
    joined = HFTokenizer.from_str(json.dumps(data))
    joined.encode_special_tokens = True
    return joined


def check_vocab(path: Path, tokenizer: Tokenizer, cfg: ModelConfig) -> None:
    """A tokenizer with more tokens than the model's embedding would feed it ids it has no row for."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{Path(path) / 'tokenizer.json'}: tokenizer has {tokenizer.vocab_size} tokens but "
                             f"config.json says vocab_size {cfg.vocab_size}")
