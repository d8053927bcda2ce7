# Two commands do all the set-up: `make demo` and `make test`.
# CPU by default; on a GPU machine run with JAX_PLATFORMS= (empty) or cuda.
PY312   ?= $(shell command -v python3.12 || echo python3)
PY311   ?= $(shell command -v python3.11 || echo python3)
VENV    := .venv
ORACLE  := .venv-oracle
PIP     := $(VENV)/bin/python -m pip
export JAX_PLATFORMS ?= cpu

.PHONY: demo test serve bench lint venv oracle clean

$(VENV)/.stamp: pyproject.toml
	$(PY312) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,serve,bench,ray]'
	touch $@

# The correctness oracle (transformers + peft on torch, CPU, float32) lives in its own
# Python 3.11 virtualenv, where a CPU build of torch installs without a download.
$(ORACLE)/.stamp: tests/oracle/requirements.txt
	$(PY311) -m venv $(ORACLE)
	$(ORACLE)/bin/python -m pip install -q -r tests/oracle/requirements.txt
	touch $@

venv: $(VENV)/.stamp
oracle: $(ORACLE)/.stamp

demo: $(VENV)/.stamp
	$(VENV)/bin/python -m slora_jax demo

test: $(VENV)/.stamp $(ORACLE)/.stamp
	SLORA_ORACLE_PYTHON=$(ORACLE)/bin/python $(VENV)/bin/python -m pytest -q -x tests

# OpenAI-compatible server on the embedded default (the demo's tiny model and 32 adapters), on
# 127.0.0.1:8000; pass flags with ARGS="--port 9000 --api-key ...".
serve: $(VENV)/.stamp
	$(VENV)/bin/python -m slora_jax serve $(ARGS)

bench: $(VENV)/.stamp
	$(VENV)/bin/python bench/engine_bench.py --model tiny --quick

lint: $(VENV)/.stamp
	$(VENV)/bin/python -m pyflakes slora_jax pallas_kernels triton_kernels bench tools tests

clean:
	rm -rf $(VENV) $(ORACLE)
