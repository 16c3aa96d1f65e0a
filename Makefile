# The two commands of README.md, each doing all set-up on a fresh machine:
#   make bench   build, then run the microbenchmark suite on the default shapes (GPU if present)
#   make test    build, then run the test suite
PYTHON ?= python3
export MAX_JOBS ?= 2

.PHONY: bench test build deps info clean

bench: build
	$(PYTHON) -m bench

test: build
	$(PYTHON) -m pytest python_tests

# Incremental in-place build (ninja keeps objects under build/); setup.py picks the flavour.
build: deps
	$(PYTHON) setup.py -q build_ext --inplace
	$(PYTHON) -m dspark_ops.info

deps:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch>=2.4"
	$(PYTHON) -m pip install -q pytest numpy

info:
	$(PYTHON) -m dspark_ops.info

clean:
	rm -rf build dspark_ops/_C*.so dspark_ops/_build_info.py
