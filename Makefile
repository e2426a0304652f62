# Two entry points, both self-installing into .venv on first use (README).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test install bench clean

# pip without -q: the first install takes minutes (PyTorch is most of it) and shows what it fetches.
$(STAMP): pyproject.toml
	@echo "installing semkv-ledger and its dependencies into $(VENV) (first run or pyproject.toml changed; ~2 min)..."
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/semkv-ledger demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/python tools/bench_ledger.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
