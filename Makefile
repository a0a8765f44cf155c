# Two commands on a fresh machine:  `make demo` (dense -> L2A on a recall task, CPU, minutes) and
# `make test`. `make demo SCHEME=<name>` runs another scheme's demo section (scripts/demo.py:
# l2a, aha, elastic, segmented, match); `make demo SCHEME=all` runs every section.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= /tmp/condattn_demo
SCHEME ?= l2a

.PHONY: setup test durations test-fast demo gpu-smoke clean

$(VENV)/.installed: pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)

setup: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 -m "not manual" tests

# `make test` and tests/durations.json refreshed from this run (each file's CPU seconds: conftest
# hands the longest files out first); commit the file when the order of the big files moved.
durations: $(VENV)/.installed
	CONDATTN_RECORD_DURATIONS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 -m "not manual" tests

demo: $(VENV)/.installed
	$(PY) scripts/demo.py --workdir=$(DEMO_DIR) --scheme=$(SCHEME)

gpu-smoke: $(VENV)/.installed
	$(PY) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) $(DEMO_DIR)
