# The two set-up commands: `make demo` and `make test`. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast models models-real models-shapes bench clean gpu-bundle

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing can pull a newer or CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,editor,voice,onnx]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m llmd.models_real --fetch-only smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
	$(BIN)/python -m llmd.demo

# Two workers (pytest-xdist), each test file on one of them so that its module fixtures are built once;
# bytecode is cached (PYTHONDONTWRITEBYTECODE emptied), since every worker and daemon subprocess imports llmd.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadfile

# the whole suite but the slow benchmarks; what CI runs (.ci/run)
test: $(STAMP)
	$(PYTEST)

# the quick tier while developing: no daemons, subprocesses, compiles, exports, training or long reference runs
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not heavy"

models: $(STAMP)
	$(BIN)/python -m llmd.training.train_demo --out models

# the two real pretrained models (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct): fetched once, checked, imported
models-real: $(STAMP)
	$(BIN)/python -m llmd.models_real

# random-weight GGUF files at the shapes people run (1.5B-8B, real tokenizer), re-typed by llama.cpp's
# llama-quantize: slow (minutes per shape, ~40 GB for all), not part of `make test`. SHAPES=all for all five.
SHAPES ?= qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b
SHAPE_TYPES ?= Q4_K_M,Q5_K_M,Q6_K,Q8_0
models-shapes: models-real
	$(BIN)/python -m llmd.bench.gguf_shapes --shapes $(SHAPES) --types $(SHAPE_TYPES)

bench: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# the folder to copy to a GPU machine without network: this tree and the cp312 wheels
# bench/gpu_check.sh needs (bench/gpu_wheels.txt), checked at <= 60 MiB
gpu-bundle: $(STAMP)
	PIP=$(BIN)/pip bench/gpu_bundle.sh gpu-bundle

clean:
	rm -rf $(VENV) build *.egg-info
