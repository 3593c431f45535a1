# kvserve: `make serve` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install system-deps serve test test-slow clean

# Debian tools the tests drive: promtool and a real Prometheus, a headless browser,
# ip and unshare (Ray runs in a private network namespace)
SYSTEM_TOOLS := promtool:prometheus prometheus:prometheus chromium:chromium ip:iproute2 unshare:util-linux

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a CUDA build.
	$(BIN)/pip install torch==2.13.0

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -e '.[dev]'
	touch $@

install: $(VENV)/.installed

system-deps:  # root installs what is missing; others get told what the tests will skip
	@missing=""; for pair in $(SYSTEM_TOOLS); do \
	  command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "kvserve: not root, so tests needing$$missing will be skipped"; fi; fi

serve: install
	@echo "kvserve: starting the OpenAI-compatible server on http://127.0.0.1:8000 (Ctrl-C stops it). Once it is up:"
	@echo "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0}'"
	@echo "  or any OpenAI client with base_url=http://127.0.0.1:8000/v1 (model: kvserve-default)"
	$(BIN)/kvserve serve --host 127.0.0.1 --port 8000

test: install system-deps
	$(BIN)/python -m pytest -q

test-slow: install system-deps  # fuzzing, a real Prometheus; CI runs it after `make test`
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
