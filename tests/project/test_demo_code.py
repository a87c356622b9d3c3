"""`make demo`'s code half: Qwen2.5-Coder-0.5B-Instruct through the daemon fills in a real function's
middle, and prompt lookup speculates a code edit without changing its greedy text. Skipped where
`make models-real` has not fetched the model."""
import pytest

from llmd.models_real import QWEN_CODER, cached_file


@pytest.fixture
def gguf():
    path = cached_file(QWEN_CODER)
    return path if path is not None else pytest.skip("Qwen2.5-Coder-0.5B-Instruct is not in the cache; run "
                                                     "`make models-real`")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_real_code_fills_the_middle_and_prompt_lookup_keeps_the_text(gguf, capsys):
    from llmd.demo import infill, plain_edit, serving, speculated_edit
    with serving("--model", str(gguf), "--draft", "ngram") as c:
        shown = infill(c)
        text, _, spec = speculated_edit(c)
    assert shown.startswith("if items[mid] == target:") and "return mid" in shown
    assert "def word_counts(path: str)" in text
    assert spec["accepted"] > 0
    assert plain_edit(gguf).text == text


@pytest.mark.heavy
def test_fetch_only_fetches_and_imports_nothing(monkeypatch, tmp_path, capsys):
    """`make demo` fetches the real models with --fetch-only: a GGUF file is served as it is."""
    from llmd import models_real
    fetched, imported = [], []
    monkeypatch.setattr(models_real, "fetch", lambda name: fetched.append(name) or tmp_path / name)
    monkeypatch.setattr(models_real, "imported_dir", lambda path: imported.append(path) or path)
    monkeypatch.setattr(models_real, "cached_import", lambda name: None)
    assert models_real.main(["--fetch-only", QWEN_CODER]) == 0
    assert (fetched, imported) == ([QWEN_CODER], [])
    assert models_real.main([QWEN_CODER]) == 0 and imported == [tmp_path / QWEN_CODER]
