# Two commands do all set-up: `make demo` and `make test`. Both create and reuse .venv.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint

$(STAMP): pyproject.toml
	# Mooncake's wheel links against libibverbs / librdmacm (Debian: libibverbs1, librdmacm1).
	@ldconfig -p | grep -q librdmacm.so.1 && ldconfig -p | grep -q libibverbs.so.1 || \
	  { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1; \
	    else echo "mmserve: install libibverbs1 and librdmacm1 (sudo apt-get install libibverbs1 librdmacm1)" >&2; exit 1; fi; }
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mmserve demo

test: $(STAMP)
	$(VENV)/bin/ruff check mmserve tests
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check mmserve tests
	$(VENV)/bin/ruff format --check mmserve tests
