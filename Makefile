# Two entry points that work on a fresh machine (see README.md):
#   make demo   - set up .venv, build torch_openreg, train a small model on openreg
#   make test   - set up .venv, build torch_openreg, run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
NATIVE := $(shell find csrc -name "*.cpp" -o -name "*.h" -o -name "*.yaml")

.PHONY: demo test bench fuzz install clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=23" "setuptools>=64" wheel ninja
	$(PY) -m pip install "torch==2.13.*" numpy pytest expecttest hypothesis pyyaml \
		"transformers>=5.24,<6" "accelerate>=1.15,<2"

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py $(NATIVE)
	$(PY) -m pip install --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m torch_openreg.demo

test: install
	$(PY) -m pytest -q tests

# The differential fuzzer over a long range of seeds (the test suite runs seeds 0:400).
FUZZ_SEEDS ?= 0:5000
fuzz: install
	$(PY) tools/fuzz.py --seeds $(FUZZ_SEEDS) --steps 40

bench: install
	$(PY) benchmarks/run.py
	$(PY) benchmarks/compile.py
	$(PY) benchmarks/fallback.py

clean:
	rm -rf build $(VENV) torch_openreg/*.so *.egg-info
