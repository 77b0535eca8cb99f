# The whole set-up is two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv with the pinned CPU stack first (torchrec is installed --no-deps: its own
# metadata would pull the multi-GB CUDA fbgemm-gpu wheel).
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip --disable-pip-version-check -q
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

$(VENV)/.installed: requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps -r requirements-nodeps.txt
	$(PIP) install --no-deps -e .
	$(VENV)/bin/python -c "import torch, fbgemm_gpu, torchrec; assert torch.__version__.startswith('2.13'), torch.__version__"
	touch $@

.PHONY: install demo test test-fast
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/opengem demo --out ./opengem-demo

$(VENV)/.test-installed: $(VENV)/.installed requirements-test.txt
	$(PIP) install -r requirements-test.txt
	touch $@

test: $(VENV)/.test-installed
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25

test-fast: $(VENV)/.test-installed
	$(VENV)/bin/python -m pytest -q -m "not slow and not distributed"
