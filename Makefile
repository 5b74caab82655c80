# neuron-serving: install, serve, test, bench, lint.
# `make test` works on a fresh clone: it installs everything it needs first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install chromium serve test bench lint clean

install: $(STAMP)

# Install fixes from DESIGN.md:
# - torchvision/torchaudio/torchcodec from PyPI do not load beside torch+cpu and
#   break `import transformers`; text models need none of them.
# - numpy 1.26: Triton's Python backend stub mis-reads BYTES tensors under numpy 2.
# - the Triton 2.51 binary ships in nvidia-pytriton; --no-deps because its pins
#   are for pytriton's Python API, which we do not use.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,dev]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/pip install -q numpy==1.26.4
	$(BIN)/pip install -q --no-deps nvidia-pytriton==0.7.0
	$(BIN)/python -c "import vllm, transformers, tritonclient.grpc, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	$(MAKE) chromium
	touch $(STAMP)

# The dashboard test drives the system's chromium (playwright never downloads one
# here). Installed only when missing, apt-get exists and we are root; a failure only
# makes that test skip, so it must not fail the install.
chromium:
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
	    && [ "$$(id -u)" = 0 ]; then \
	  timeout 600 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium' \
	    || echo "chromium not installed: the dashboard browser test will skip"; \
	fi || true

serve: $(STAMP)
	$(BIN)/neuron-serving up

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=15

# Every benchmark at its --quick sizes (about 20 minutes on 2 cores; `bench all --full`
# for the default sizes), then bench/REPORT.md; per-benchmark wall times at the end.
bench: $(STAMP)
	$(BIN)/neuron-serving bench all

lint: $(STAMP)
	$(BIN)/ruff check neuron_serving proxy tests bench triton_models
	$(BIN)/ruff format --check neuron_serving proxy tests bench triton_models

clean:
	rm -rf $(VENV)
