# Two commands on a fresh machine:  `make demo` (tiny L2A-style run on CPU) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= /tmp/condattn_demo

.PHONY: setup test test-fast demo gpu-smoke clean

$(VENV)/.installed: pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)

setup: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile tests

demo: $(VENV)/.installed
	$(PY) scripts/demo.py --workdir=$(DEMO_DIR)

gpu-smoke: $(VENV)/.installed
	$(PY) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) $(DEMO_DIR)
