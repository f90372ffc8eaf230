# Set-up is idempotent: every target that needs the venv depends on its stamp file.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
KVFLASH := $(VENV)/bin/kvflash
# A CUDA machine takes the torch build of the index; elsewhere the CPU wheel 2.13.0.
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST  := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: setup model demo test test-slow test-gpu test-reliability lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check "$(TORCH)"
	$(PIP) install -q --disable-pip-version-check -e '.[test]'
	touch $@

setup: $(VENV)/.installed

model: setup
	$(KVFLASH) model pull

DEMO_DOC   := demo/harbor_chronicle.txt
DEMO_STORE := .demo-store

# Turn 1 prefills the ~8K-token document cold and snapshots it; turn 2 (a new process) restores it.
demo: model
	rm -rf $(DEMO_STORE)
	@echo "== turn 1: cold prefill of $(DEMO_DOC) =="
	$(KVFLASH) ask $(DEMO_DOC) "Who built the lighthouse of Port Elden, and when?" --store $(DEMO_STORE) -n 48
	@echo "== turn 2: a new process restores the document's KV from disk =="
	$(KVFLASH) ask $(DEMO_DOC) "What is the Copper Oven famous for?" --store $(DEMO_STORE) -n 48
	$(KVFLASH) snapshot list --store $(DEMO_STORE)

test: model
	$(PYTEST)

test-slow: model
	$(PYTEST) -m slow --timeout 3600

test-gpu: model
	$(PYTEST) -m gpu

test-reliability: model
	$(PYTEST) -m reliability -s

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
