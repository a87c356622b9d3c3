"""The decode-ceiling benchmark reads a model's weight bytes and prints the bound they allow."""
import pytest

from llmd.bench.membw import main, weight_bytes


def test_weight_bytes_of_a_file_and_of_a_directory(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "m" / "config.json").write_text("{}")             # not weights
    (tmp_path / "f.gguf").write_bytes(b"y" * 300)
    assert weight_bytes(tmp_path / "m") == 1000 and weight_bytes(tmp_path / "f.gguf") == 300
    with pytest.raises(FileNotFoundError):
        weight_bytes(tmp_path / "missing")


@pytest.mark.heavy
def test_main_prints_the_bandwidth_and_each_models_ceiling(tmp_path, capsys):
    (tmp_path / "f.gguf").write_bytes(b"y" * 4096)
    assert main(["--threads", "1", "--size-mib", "64", "--rounds", "1", str(tmp_path / "f.gguf")]) == 0
    out = capsys.readouterr().out
    assert "read bandwidth:" in out and "f.gguf: 0.0 MB of weights, at most" in out
    assert main(["--size-mib", "64", "--rounds", "1", str(tmp_path / "nope.gguf")]) == 2
