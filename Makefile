# The two set-up commands: `make demo` and `make test`. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test models models-real bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing can pull a newer or CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,editor,voice,onnx]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m llmd.models_real smollm2-135m-instruct
	$(BIN)/python -m llmd.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

models: $(STAMP)
	$(BIN)/python -m llmd.export.train_demo --out models

# the two real pretrained models (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct): fetched once, checked, imported
models-real: $(STAMP)
	$(BIN)/python -m llmd.models_real

bench: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
