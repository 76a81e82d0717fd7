# make demo: set up .venv and run the demo job on a small corpus it builds itself.
# make test: set up .venv (with the test extras) and run the test suite.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# -qq: pip prints errors only.
PIP_FLAGS := -qq --disable-pip-version-check --no-input
# Parallel by default: tests share no files or ports (tmp_path, one S3 server per worker).
# `make test PYTEST_ARGS=` runs serially; `make test PYTEST_ARGS="-k format"` narrows.
PYTEST_ARGS ?= -n 2
export DEBIAN_FRONTEND := noninteractive

.PHONY: test test-torchtitan demo venv venv-test venv-bench zstd-cli ext clean

# torchtitan's venv is set up in the background while the main suite runs (pip waits mostly on
# downloads); its log is printed where the setup fails. (SUBMAKE: a recipe line naming $(MAKE)
# itself would run under `make -n` too.)
SUBMAKE = $(MAKE)
test: venv-test zstd-cli ext
	@( $(SUBMAKE) --no-print-directory $(TT_VENV)/.installed > $(TT_VENV).log 2>&1; echo $$? > $(TT_VENV).rc ) & \
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; wait; \
	if [ "$$(cat $(TT_VENV).rc)" != 0 ]; then echo "setting up $(TT_VENV) failed:"; cat $(TT_VENV).log; exit 1; fi; \
	[ $$rc = 0 ] || exit $$rc
	$(MAKE) test-torchtitan

demo: venv
	$(VENV)/bin/streamforge demo $(DEMO_ARGS)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch goes in first, on its own and pinned, so the resolver never picks an unpinned one.
$(VENV)/.installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) install $(PIP_FLAGS) -c constraints.txt torch
	$(PIP) install $(PIP_FLAGS) -c constraints.txt -e '.[plot]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install $(PIP_FLAGS) -c constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# The compiled core (streamforge/pipeline/_core.c), built in place: the editable install builds
# it only when pip runs, and the tests must run the C in the tree (a no-op when up to date;
# through pip where the venv has no setuptools, as from Python 3.12). The build is optional
# for users; here it must succeed (STREAMFORGE_EXT_REQUIRED=1), unless STREAMFORGE_NO_EXT=1
# asks for the numpy path alone (the tests then leave the compiled core out).
ext: venv-test
	@if [ "$${STREAMFORGE_NO_EXT:-0}" != 0 ]; then echo "STREAMFORGE_NO_EXT is set: the numpy path alone"; \
	elif $(PY) -c "import setuptools" 2>/dev/null; then STREAMFORGE_EXT_REQUIRED=1 $(PY) setup.py -q build_ext --inplace; \
	else STREAMFORGE_EXT_REQUIRED=1 $(PIP) install $(PIP_FLAGS) -c constraints.txt --no-deps -e .; fi

venv-test: $(VENV)/.installed-test

# torchtitan's tests run in their own venv: torchtitan 0.3 pins fsspec<=2026.2.0 (through
# datasets), which the main venv's s3fs must not share. pip resolves streamforge's test extras
# and torchtitan in one command, so s3fs and gcsfs come at matching versions
# (docs/integrations-torchtitan.md).
TT_VENV ?= .venv-torchtitan
TT_PY := $(TT_VENV)/bin/python

$(TT_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(TT_VENV)
	$(TT_PY) -m pip install $(PIP_FLAGS) -c constraints.txt torch
	$(TT_PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test,torchtitan]'
	touch $@

test-torchtitan: $(TT_VENV)/.installed
	$(TT_PY) -m pytest -q -p no:cacheprovider tests/test_torchtitan.py

# tools/bench_peers.py: streamforge next to Grain, LitData, MosaicML Streaming and WebDataset, in a
# venv of its own: mosaicml-streaming pins google-cloud-storage below what gcsfs (a test
# extra) needs, so the two extras cannot share one environment.
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml constraints-bench.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install $(PIP_FLAGS) -c constraints-bench.txt torch torchvision
	$(BENCH_VENV)/bin/python -m pip install $(PIP_FLAGS) -c constraints-bench.txt -e '.[bench]'
	touch $@

venv-bench: $(BENCH_VENV)/.installed

# The interop tests pipe shards through the zstd CLI. Install it when we can; otherwise
# those tests skip and say why.
zstd-cli:
	@command -v zstd >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing the zstd CLI (apt-get)"; \
	    apt-get install -y -qq zstd >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq zstd >/dev/null 2>&1; } || \
	      echo "warning: could not install zstd; the zstd CLI interop tests will be skipped"; \
	  else \
	    echo "warning: no zstd CLI and not root; the zstd CLI interop tests will be skipped"; \
	  fi; }

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(TT_VENV) demo-out .hypothesis build streamforge/pipeline/_core.*.so
