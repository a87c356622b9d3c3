"""llama.cpp's vocabulary-only GGUF files and their expected token ids, for the tokenizer tests.

llama.cpp ships `models/ggml-vocab-<kind>.gguf` with `.inp` (test strings, each followed by a marker
line) and `.out` (the ids of each string, one line each). They live in the llama.cpp source that
bench/build_llama_server.sh unpacks from the llama-cpp-python sdist; where that source is absent,
``vocab_dir`` downloads the same sdist and unpacks only those files, into a folder of their own
beside the build (an incomplete source tree where the build script looks would stop it unpacking).
``LlamaTokenize`` runs llama.cpp's `llama-tokenize` on a vocabulary, one string per process, and keeps
its answers in a cache file beside the build, so a second run asks it nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmd.bench.llama_server import CACHE as BUILD_DIR

VERSION = os.environ.get("LLMD_LLAMA_CPP_PYTHON", "0.3.36")
SDIST = f"llama_cpp_python-{VERSION}"
MODELS_IN = "vendor/llama.cpp/models"
SOURCE_MODELS = BUILD_DIR / "src" / SDIST / MODELS_IN          # where the build unpacks the whole source
FETCHED_MODELS = BUILD_DIR / f"vocab-{SDIST}"                     # where only the vocabularies are unpacked
TOKENIZE = BUILD_DIR / "bin" / "llama-tokenize"
CACHE = BUILD_DIR / "tokenize-cache"                                # llama-tokenize's answers, per vocabulary
MARKER = "\n__ggml_vocab_test__\n"
FETCH_TIMEOUT_S = 600


def vocab_dir() -> tuple[Path | None, str]:
    """(the folder of ggml-vocab-* files, "") or (None, why not)."""
    for folder in (SOURCE_MODELS, FETCHED_MODELS):
        if any(folder.glob("ggml-vocab-*.gguf")):
            return folder, ""
    try:
        if (local := BUILD_DIR / "src" / f"{SDIST}.tar.gz").is_file():
            _unpack_vocab(local)
        else:
            with tempfile.TemporaryDirectory(prefix="llmd-sdist-") as tmp:
                _unpack_vocab(_download_sdist(Path(tmp)))
    except (OSError, subprocess.SubprocessError, tarfile.TarError) as e:
        said = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip().splitlines()[-1:]
        return None, f"llama.cpp's vocabulary files are not cached and could not be fetched: {e} {' '.join(said)}"
    found = any(FETCHED_MODELS.glob("ggml-vocab-*.gguf"))
    return (FETCHED_MODELS, "") if found else (None, f"{SDIST} holds no vocabulary files")


def _download_sdist(dest: Path) -> Path:
    """pip download of the sdist, the way bench/build_llama_server.sh does it (its build backend from
    a wheel into a side folder, since pip prepares an sdist's metadata even to download it)."""
    tools = BUILD_DIR / "tools"
    pip = [sys.executable, "-m", "pip", "-q"]
    if not (tools / "scikit_build_core").is_dir():
        subprocess.run([*pip, "install", "--target", str(tools), "scikit-build-core"], check=True,
                       timeout=FETCH_TIMEOUT_S, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(tools)}
    subprocess.run([*pip, "download", "--no-binary", ":all:", "--no-deps", "--no-build-isolation", "-d", str(dest),
                    f"llama-cpp-python=={VERSION}"], check=True, timeout=FETCH_TIMEOUT_S, capture_output=True, env=env)
    return dest / f"{SDIST}.tar.gz"


def _unpack_vocab(sdist: Path) -> None:
    prefix = f"{SDIST}/{MODELS_IN}/ggml-vocab-"
    FETCHED_MODELS.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if member.name.startswith(prefix) and member.isfile():
                (FETCHED_MODELS / Path(member.name).name).write_bytes(tar.extractfile(member).read())


def expected_cases(models: Path, kind: str) -> list[tuple[str, list[int]]]:
    """(string, llama.cpp's ids) for each test of ``kind``, read as llama.cpp's own test reads them."""
    raw = (models / f"ggml-vocab-{kind}.gguf.inp").read_bytes().decode("utf-8")
    lines = (models / f"ggml-vocab-{kind}.gguf.out").read_text(encoding="utf-8").split("\n")
    strings = raw.split(MARKER)
    if strings and strings[-1] == "":
        strings.pop()
    return [(s, [int(t) for t in line.split()]) for s, line in zip(strings, lines)]


class LlamaTokenize:
    """``ids(strings, parse_special, add_special)``: llama-tokenize's ids for each string, cached."""

    def __init__(self, vocab: Path, binary: Path = TOKENIZE, workers: int = 2):
        self.vocab, self.binary, self.workers = vocab, binary, workers
        digest = hashlib.sha256(vocab.read_bytes()).hexdigest()[:16]
        self.cache_path = CACHE / f"{vocab.stem}-{digest}.json"
        self.cache = json.loads(self.cache_path.read_text()) if self.cache_path.is_file() else {}

    def ids(self, strings: list[str], parse_special: bool = True, add_special: bool = False) -> list[list[int]]:
        keys = [self._key(s, parse_special, add_special) for s in strings]
        todo = {k: s for k, s in zip(keys, strings) if k not in self.cache}
        with ThreadPoolExecutor(self.workers) as pool:
            for key, ids in zip(todo, pool.map(lambda s: self._run(s, parse_special, add_special), todo.values())):
                self.cache[key] = ids
        if todo:          # whole or not at all: another test process may be reading it
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            part = self.cache_path.with_name(f"{self.cache_path.name}.{os.getpid()}.part")
            part.write_text(json.dumps(self.cache))
            os.replace(part, self.cache_path)
        return [self.cache[k] for k in keys]

    @staticmethod
    def _key(text: str, parse_special: bool, add_special: bool) -> str:
        flags = f"{int(parse_special)}{int(add_special)}"
        return flags + hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]

    def _run(self, text: str, parse_special: bool, add_special: bool) -> list[int]:
        with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            args = [str(self.binary), "-m", str(self.vocab), "-f", f.name, "--ids", "--log-disable", "--no-escape"]
            args += [] if parse_special else ["--no-parse-special"]
            args += [] if add_special else ["--no-bos"]
            out = subprocess.run(args, capture_output=True, timeout=120, check=True).stdout.decode()
        return json.loads(out.strip().splitlines()[-1])


# ---- generated test strings ---------------------------------------------------------------------
SCRIPTS = {
    "latin": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "accented": "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿÀÁÂÄÅÇÉÑÖÜßĀāăąćčďđēęěğīıłńňőœřśşšťūůűźżžſ",
    "greek": "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΘΛΞΠΣΦΨΩάέήίόύώ",
    "cyrillic": "абвгдежзийклмнопрстуфхцчшщъыьэюяАБВГДЕЖЗИЙКЛМНОПРСТУФХЦЧШЩЪЫЬЭЮЯёЁії",
    "hebrew": "אבגדהוזחטיכלמנסעפצקרשתםןףץ",
    "arabic": "ءابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "devanagari": "कखगघचछजझटठडढणतथदधनपफबभमयरलवशसहािीुूेैोौ्ं",
    "thai": "กขคงจฉชซญฎฏฐดตถทธนบปผฝพฟภมยรลวศษสหอฮะาำิีึืุู่้๊๋",
    "cjk": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后",
    "kana": "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコ",
    "hangul": "가나다라마바사아자차카타파하한국어안녕세계",
    "emoji": "😀😃😄😁😆😅🤣😂🙂🙃😉😊😇🥰😍🤩😘🦙🔥👍🏽❤️✨🎉🚀🐍",
    "marks": "\u0300\u0301\u0302\u0303\u0308\u0327\u20dd\u200d\ufe0f",
    "symbols": "€£¥©®™°±×÷→←↑↓∑∏√∞≈≠≤≥∂∫♥♦♣♠★☆✓✗§¶•…‘’“”«»",
    "fullwidth": "！＂＃＄％＆（）＊＋，－．／０１２３４５６７８９：；＜＝＞？＠ＡＢＣａｂｃ",
    "digits": "0123456789٠١٢٣٤٥٦٧٨٩०१२३४५६७८९",
    "punct": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
}
SPACES = [" ", " ", " ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2009", "\u200b", "\u2028", "\x0b", "\x0c"]
CODE = [
    "def {a}({b}, {c}=None):\n    if {b} is None:\n        return []\n    return [{c} * 2 for {c} in {b}]\n",
    "int {a}(int {b}) {{\n\tfor (int i = 0; i < {b}; ++i) {{\n\t\t{c}[i] += i * {n};\n\t}}\n\treturn {b} >> 1;\n}}\n",
    "const {a} = async ({b}) => {{\n  const {{ {c} }} = await fetch(`/api/${{{b}}}`);\n  return {c} ?? {n};\n}};",
    '{{"{a}": [{n}, {n}.5, -{n}e-3], "{b}": {{"{c}": null, "ok": true}}}}',
    "<div class=\"{a}\">\n  <p id='{b}'>{c} &amp; {n}</p>\n</div>",
    "for f in $(ls *.{a}); do\n    echo \"$f\" | grep -E '^[0-9]{{{n}}}' >> {b}.log\ndone",
    "SELECT {a}, COUNT(*) AS {b} FROM {c} WHERE id >= {n} GROUP BY {a};",
    "    # {a}: {b}\n    {c}.append(x**{n})  # noqa\n\n\n",
    "fn {a}(&mut self, {b}: &[u8]) -> Result<usize, {c}> {{ Ok({b}.len() + {n}) }}",
]


class StringMaker:
    """Seeded strings of every flavour the tokenizer must agree on: llama.cpp's own test strings,
    unicode from many scripts, whitespace runs, digit runs, code, and special-token text."""

    def __init__(self, seed: int, base: list[str], specials: list[str]):
        import random
        self.rng, self.base, self.specials = random.Random(seed), [b for b in base if b], specials

    def make(self, n: int) -> list[str]:
        makers = [self.unicode, self.whitespace, self.digits, self.code, self.special, self.mixed, self.from_base]
        return [makers[i % len(makers)]() for i in range(n)]

    def word(self, script: str | None = None) -> str:
        chars = SCRIPTS[script or self.rng.choice(list(SCRIPTS))]
        return "".join(self.rng.choice(chars) for _ in range(self.rng.randint(1, 8)))

    def space(self) -> str:
        return "".join(self.rng.choice(SPACES) for _ in range(self.rng.choice([1, 1, 1, 2, 3, 5, 9])))

    def unicode(self) -> str:
        return "".join(self.word() + self.rng.choice([" ", " ", "", ", ", ". ", "-", "'s "])
                       for _ in range(self.rng.randint(1, 10)))

    def whitespace(self) -> str:
        parts = [self.space() if i % 2 == 0 else self.word("latin") for i in range(self.rng.randint(1, 7))]
        return "".join(parts) + (self.space() if self.rng.random() < 0.5 else "")

    def digits(self) -> str:
        r = self.rng
        def number():
            s = "".join(r.choice("0123456789") for _ in range(r.randint(1, 24)))
            return r.choice([s, s + "." + s[:3], "-" + s, s[:3] + "," + s[3:6], "0x" + s[:6],
                             r.choice(SCRIPTS["digits"]) + s])
        return r.choice([" ", "", "\n", " + ", "x"]).join(number() for _ in range(r.randint(1, 6)))

    def code(self) -> str:
        r = self.rng
        names = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(r.randint(1, 10))) for _ in range(3)]
        text = r.choice(CODE).format(a=names[0], b=names[1], c=names[2], n=r.randint(0, 10 ** r.randint(1, 6)))
        return text.replace("    ", r.choice(["    ", "  ", "\t", "        "]))

    def special(self) -> str:
        r = self.rng
        if not self.specials:
            return self.unicode()
        parts = []
        for _ in range(r.randint(1, 4)):
            s = r.choice(self.specials)
            parts.append(s[:r.randint(1, len(s))] if r.random() < 0.15 else s)
            parts.append(r.choice(["", " ", "\n", "  ", self.word(), " " + self.word("latin") + " "]))
        return r.choice(["", " ", "hello"]) + "".join(parts)

    def mixed(self) -> str:
        pieces = [self.unicode, self.whitespace, self.digits, self.code, self.special]
        return "".join(self.rng.choice(pieces)() for _ in range(self.rng.randint(2, 4)))

    def from_base(self) -> str:
        if not self.base:
            return self.unicode()
        a, b = self.rng.choice(self.base), self.rng.choice(self.base)
        return self.rng.choice([a + b, a + self.space() + b, a[: len(a) // 2] + self.word() + b[len(b) // 2:]])
