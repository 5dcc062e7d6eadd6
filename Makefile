# uv is installed with pip when it is missing; PyPI's torch (a large CUDA build) is then kept in uv's cache.
UV := $(shell command -v uv 2>/dev/null || echo python3 -m uv)
CARGO ?= cargo

DIST ?= dist

.PHONY: install run test lint typecheck bench wheels

# --compile-bytecode: uv, unlike pip, leaves the installed packages' bytecode to be compiled at first import, and
# where PYTHONDONTWRITEBYTECODE is set it is compiled again in every process (torch, transformers and Ray in
# each of a run's workers: half of a run's start-up). Compiled once here; a sync with nothing new takes 1 s.
install:  ## create .venv with every package, extra and dev tool, building the Rust extension
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) sync --all-packages --all-extras --locked --compile-bytecode

run: install  ## run the main job: asyncrl-run's embedded default (async agentic RL on searchr1-mini, a tiny warm-started Llama)
	$(UV) run asyncrl-run runner.run_dir=runs/searchr1-mini-$$(date +%Y%m%d-%H%M%S)

test: install lint typecheck  ## the whole suite, as CI runs it
	$(CARGO) test --workspace
# loom models of the buffer's admission: own target dir (--cfg loom rebuilds every crate); optimised,
# since loom explores thousands of executions, but without LTO, to keep the build short
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom CARGO_PROFILE_RELEASE_LTO=false \
	  CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 $(CARGO) test -p buffer_core --release --test loom
	$(UV) run pytest --durations=25

wheels:  ## build the wheel of every distribution into $(DIST)/ (the Rust extension is in asyncrl-core's, abi3)
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) build --all-packages --wheel --out-dir $(DIST)

lint:  ## ruff, rustfmt, clippy and the guide's strict build, warnings as errors
	$(UV) run ruff check .
	$(UV) run ruff format --check .
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --features buffer_core/python -- -D warnings
# the user guide, warnings as errors (links and anchors included); offline
	NO_MKDOCS_2_WARNING=1 $(UV) run mkdocs build --strict --quiet -f docs/mkdocs.yml

typecheck:  ## pyright (strict on packages/*/src) and stubtest of the Rust extension's .pyi
	$(UV) run pyright
	$(UV) run python -m mypy.stubtest asyncrl_core._buffer_core

bench:  ## microbenchmarks of the admission path
	$(CARGO) bench -p buffer_core
	$(UV) run pytest benchmarks/micro --benchmark-enable --benchmark-only
	$(UV) run python benchmarks/micro/admission.py
