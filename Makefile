# The two commands of the README: `make demo` and `make test`. Each installs what is missing,
# builds (Release) and runs.
BUILD := build
JOBS ?= 2

.PHONY: demo test build deps configure bench fixtures clean format

deps:
	@scripts/install-deps

$(BUILD)/build.ninja:
	cmake --preset release

configure: $(BUILD)/build.ninja

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

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

fixtures:
	@scripts/install-deps --torch
	.venv/bin/python scripts/gen-fixtures

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp')

clean:
	rm -rf $(BUILD)
