# Two entry points that work on a fresh machine (see README.md):
#   make demo   - set up .venv, build torch_openreg, train a small model on openreg
#   make test   - set up .venv, build torch_openreg, run the test suite twice (the default mode,
#                 then the asynchronous kernel mode, OPENREG_ASYNC=1), build the guide
#   make docs   - build the guide (docs/) into docs/_build/html, warnings and broken links as errors
VENV ?= .venv
PY := $(VENV)/bin/python
DOCS_TOOLS := "sphinx==9.0.4" "myst-parser==5.2.0"
NATIVE := $(shell find csrc -name "*.cpp" -o -name "*.h" -o -name "*.yaml")

.PHONY: demo test docs bench fuzz install clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=23" "setuptools>=64" wheel ninja
	$(PY) -m pip install "torch==2.13.*" numpy pytest expecttest hypothesis pyyaml \
		"transformers>=5.24,<6" "accelerate>=1.15,<2" $(DOCS_TOOLS)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py $(NATIVE)
	$(PY) -m pip install --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m torch_openreg.demo

# The second run queues every kernel on its stream (docs/async_mode.md): correct programs must
# give the same results, and a test missing a synchronization shows.
test: install
	$(PY) -m pytest -q tests
	OPENREG_ASYNC=1 $(PY) -m pytest -q tests
	$(MAKE) docs

# The guide as one Sphinx + MyST site. -W: every warning fails the build, among them a link to a
# page or heading anchor that does not exist (internal link check) and a page in no toctree.
# A .venv made before the docs tools were added gets them here.
$(VENV)/.docs-tools: $(VENV)/bin/python
	$(PY) -m pip install $(DOCS_TOOLS)
	touch $@

docs: $(VENV)/.docs-tools
	$(PY) tools/docs_quotes.py
	$(PY) -m sphinx -W --keep-going -n -q -b html docs docs/_build/html
	@echo "guide: docs/_build/html/index.html"

# The differential fuzzer over a long range of seeds (the test suite runs seeds 0:400).
FUZZ_SEEDS ?= 0:5000
fuzz: install
	$(PY) tools/fuzz.py --seeds $(FUZZ_SEEDS) --steps 40

bench: install
	$(PY) benchmarks/run.py
	$(PY) benchmarks/compile.py
	$(PY) benchmarks/fallback.py

clean:
	rm -rf build $(VENV) torch_openreg/*.so *.egg-info docs/_build
