"""`make demo`'s real answer: SmolLM2-135M-Instruct through the daemon knows the capital of France.
Skipped where `make models-real` has not fetched the model."""
import pytest

from llmd.models_real import SMOLLM2, cached_file


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_demo_answers_paris(capsys):
    from llmd.demo import real_chat
    gguf = cached_file(SMOLLM2)
    if gguf is None:
        pytest.skip("SmolLM2-135M-Instruct is not in the cache; run `make models-real`")
    answer = real_chat(gguf)
    assert "Paris" in answer
    out = capsys.readouterr().out
    assert "[sentence 0]" in out and "Paris" in out
