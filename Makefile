PYTHON ?= python3

.PHONY: setup test serve
setup:  ## install Capstan and its test dependencies
	$(PYTHON) -m pip install -q -e ".[dev]"

test:   ## the whole test suite (the cluster tests build their binaries once, then reuse them)
	$(PYTHON) -m pytest -q

serve:  ## serve the embedded default model on 127.0.0.1:8000
	capstan serve
