# make demo   set up .venv and run the demo sweep (prints the divergence map)
# make test   set up .venv and run the whole test suite
# make test-gpu  the whole suite on a CUDA machine, the tests marked `cuda` included (skipped elsewhere)
# GPU users: make setup TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
TEST_WORKERS ?= 2  # pytest-xdist processes; tests sharing a server are grouped on one (xdist_group)
PY := $(VENV)/bin/python
# pytest with bytecode caches on, whatever the environment says (some images set PYTHONDONTWRITEBYTECODE=1): without
# them each xdist worker rewrites and compiles every test module again (~9 of its ~23 CPU-s of collection on a 2-core
# AVX2 EPYC) and every Python process a test starts compiles the project's sources (~0.5 CPU-s each). The caches go
# to __pycache__/, which git ignores.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

.PHONY: setup demo test test-gpu lint bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m sweep -m +experiment=demo

test: setup lint
	bash scripts/install_chromium.sh  # the HTML report's browser test drives Debian's chromium
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadgroup --durations=40

test-gpu: setup lint  # refuses to start where torch sees no CUDA device: the `cuda` tests would only be skipped
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA device; install the CUDA build (see the top of this Makefile)')"
	bash scripts/install_chromium.sh
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadgroup --durations=40

lint: setup  # ruff's settings are in pyproject.toml
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

bench: setup
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) outputs
