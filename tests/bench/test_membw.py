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


@pytest.mark.heavy
def test_types_time_each_product_against_the_bandwidth(capsys):
    assert main(["--threads", "1", "--size-mib", "64", "--rounds", "1", "--types", "Q8_0,Q6_K"]) == 0
    out = capsys.readouterr().out
    for t in ("Q8_0", "Q6_K"):
        line = next(l for l in out.splitlines() if l.startswith(f"{t} product, one row:"))
        assert "% of the bandwidth" in line or "do not run" in line
    with pytest.raises(SystemExit):
        main(["--types", "Q7_K"])


def test_random_blocks_hold_finite_scales_and_give_the_products_values():
    """The timed weight is well formed: every value finite, and the product is its dequantized form's
    up to the rounding of x to 8 bits a value (within 3 % of |w_n| |x| a row: that rounding is under 1 %)."""
    import numpy as np
    import torch
    from llmd.bench.membw import PRODUCT_K
    from llmd.bench.random_blocks import BLOCK_TYPES, random_blocks
    from llmd.runtime.formats.gguf_native import TYPES, GGUFLinear
    for name in BLOCK_TYPES:
        blocks = random_blocks(name, 16, PRODUCT_K, np.random.default_rng(0))
        w = GGUFLinear(PRODUCT_K, [(TYPES[name], torch.from_numpy(blocks))])
        dense = w.dense_weight()
        assert torch.isfinite(dense).all(), name
        x = torch.randn(1, PRODUCT_K)
        err = (w(x) - x @ dense.t()).abs()[0]
        assert (err <= 0.03 * dense.norm(dim=1) * x.norm()).all(), name
