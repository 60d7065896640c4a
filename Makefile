# The two commands of the README: `make demo` and `make test`. Each installs what is missing,
# builds (Release) and runs.
BUILD := build
JOBS ?= 2

.PHONY: demo test test-sanitize build deps configure bench fixtures clean format fuzz

deps:
	@scripts/install-deps

$(BUILD)/build.ninja:
	cmake --preset release

configure: $(BUILD)/build.ninja

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# The whole suite under AddressSanitizer (leaks too) and UBSan (docs/hardening.md, "Sanitizers"):
# builds the debug preset into build-debug, runs ctest there with every sanitizer report fatal
# and logged, and prints tests passed / failed and the number of reports; fails unless all
# tests pass and that number is 0. Extra ctest arguments: make test-sanitize SANITIZE_ARGS="-R Emu".
SANITIZE_ARGS ?=
test-sanitize: deps
	scripts/test-sanitize --jobs $(JOBS) $(if $(SANITIZE_ARGS),-- $(SANITIZE_ARGS))

# Trains LeNet-5 with LeCun's scaled tanh (a custom op) on Fashion-MNIST, on the GPU when there is
# one; logs, plot and checkpoints go to runs/<model>-<time>/. Extra flags: make demo DEMO_ARGS="--epochs 2".
# Builds only the tool it runs.
DEMO_ARGS ?=
demo: deps configure
	cmake --build $(BUILD) -j $(JOBS) --target kgraph
	$(BUILD)/kgraph train --device auto $(DEMO_ARGS)

bench: build
	@scripts/install-deps --python
	scripts/bench

# One CPU training step of LeNet-5 (scaled tanh and ReLU; batch 64 and 256; 2 and 1 threads) against
# PyTorch on the same weights and batch, interleaved in one run (docs/benchmarks.md). PyTorch goes
# into .venv. Extra flags: make bench-train BENCH_TRAIN_ARGS="--epoch --threads 2".
.PHONY: bench-train
BENCH_TRAIN_ARGS ?=
bench-train: build
	@scripts/install-deps --torch
	scripts/bench-train --no-build $(BENCH_TRAIN_ARGS)

# The libFuzzer targets (docs/hardening.md): builds the fuzz preset (clang 16 or newer, ASan
# and UBSan) into build-fuzz, then runs each target for FUZZ_SECONDS on a copy of its seed corpus;
# fails when one finds a crash. make fuzz FUZZ_SECONDS=300 FUZZ_JOBS=2 FUZZ_TARGETS="idx ptx".
# FUZZ_CPU_SECONDS=1800 runs each target until it has used that much CPU time instead.
FUZZ_SECONDS ?= 60
FUZZ_CPU_SECONDS ?=
FUZZ_JOBS ?= 1
FUZZ_TARGETS ?=
FUZZ_CXX ?=
fuzz:
	@scripts/install-deps --fuzz
	@cxx="$(FUZZ_CXX)"; [ -n "$$cxx" ] || cxx=$$(for v in 21 20 19 18 17 16; do command -v clang++-$$v && break; done); \
	  test -f build-fuzz/build.ninja || cmake --preset fuzz -DCMAKE_CXX_COMPILER=$${cxx:-clang++}
	cmake --build --preset fuzz -j $(JOBS)
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz --build-dir build-fuzz --jobs $(FUZZ_JOBS) \
	  $(if $(FUZZ_CPU_SECONDS),--cpu-seconds $(FUZZ_CPU_SECONDS)) $(FUZZ_TARGETS)

fixtures:
	@scripts/install-deps --torch
	.venv/bin/python scripts/gen-fixtures

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp')

clean:
	rm -rf $(BUILD)
