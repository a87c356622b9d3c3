"""An architecture is its one file in ``runtime/models/architectures/``: no other source file names it.

Its names (config.json's ``architectures`` entry and ``model_type``, its GGUF ``general.architecture``)
appear as a string in code nowhere else in the package, so the loader, the fused step, the ONNX
export and the GGUF reader, loader and writer take it from the file's layer plan and GGUF family.
Docstrings and comments may name it; tests are outside the package. Left out: Llama and Qwen2, the
architectures llmd's own toy models and training write, whose names are also tokenizer names
(``llama`` is SentencePiece in GGUF, ``qwen2`` a pre-tokenizer), and ``phi3``, a model name whose
special tokens swallow spaces; the rest of Phi-3's names are checked.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llmd.runtime.models import registry

REPO = Path(__file__).resolve().parents[2]
PACKAGE = [p for p in REPO.rglob("*.py")
           if p.relative_to(REPO).parts[0] not in {"tests", "models", "docs", "build"}
           and not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
ARCH_DIR = REPO / "runtime" / "models" / "architectures"
SHARED_NAMES = {"LlamaForCausalLM", "llama", "Qwen2ForCausalLM", "qwen2", "phi3"}


def code_strings(path: Path) -> set[str]:
    """The string constants of ``path``'s code, docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs}


def architectures() -> list[registry.Architecture]:
    return [registry.get(name) for name in registry.supported()]


def names_of(arch: registry.Architecture) -> set[str]:
    return ({arch.name, arch.model_type} | ({arch.gguf.name} if arch.gguf else set())) - SHARED_NAMES


@pytest.fixture(scope="module")
def strings() -> dict[Path, set[str]]:
    return {p: code_strings(p) for p in PACKAGE}


@pytest.mark.parametrize("arch", [a for a in architectures() if names_of(a)], ids=lambda a: a.name)
def test_no_other_file_names_the_architecture(arch, strings):
    own = [p for p in PACKAGE if p.parent == ARCH_DIR and arch.name in strings[p]]
    assert len(own) == 1, f"{arch.name} should be registered by one file of {ARCH_DIR}"
    elsewhere = {str(p.relative_to(REPO)): sorted(strings[p] & names_of(arch)) for p in PACKAGE
                 if p != own[0] and strings[p] & names_of(arch)}
    assert not elsewhere, f"{arch.name} is named outside its file: {elsewhere}"


def test_every_gguf_architecture_is_declared_by_its_file():
    declared = registry.by_gguf()
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"} <= set(declared)
    for name, arch in declared.items():
        assert arch.gguf.name == name and arch.gguf.layer, name


def test_the_walk_sees_a_name_in_code_and_not_in_a_docstring(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Gemma3ForCausalLM in a docstring."""\nKNOWN = {"gemma3": 1}  # Gemma3ForCausalLM\n')
    assert code_strings(planted) == {"gemma3"}
