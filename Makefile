# inferd developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PNNX   := pnnx==20261020
RUNDIR ?= $(or $(XDG_RUNTIME_DIR),/tmp/inferd-$(shell id -u))
SOCKET ?= ipc://$(RUNDIR)/inferd/inferd.sock

# Debian packages the build and the tests need (libzmq3-dev, libjansson-dev, g++ and
# pkg-config: libinferd, its C++ header and the C client example; fonts: the OCR tests
# render their images; pocl + OpenCL headers and loader: the OpenCL custom op example and
# its tests; Mesa's Vulkan drivers, lavapipe among them, and the loader: the ncnn
# backend's Vulkan tests; espeak-ng and sox: the VAD stream test speaks its WAV).
# Installed by `make setup` when run as root.
SYSTEM_PACKAGES := python3-venv gcc g++ libc6-dev libzmq3-dev libjansson-dev pkg-config \
	fonts-dejavu-core \
	pocl-opencl-icd ocl-icd-libopencl1 opencl-headers ocl-icd-opencl-dev \
	mesa-vulkan-drivers vulkan-tools libvulkan1 \
	espeak-ng sox

.PHONY: setup system-packages run test test-fast soak bench clean examples deb deb-test lint libinferd \
        venv-rknn test-rknn lint-duplicates deb-test-systemd deb-test-arm64 wheels apt-repo \
        deb-test-deps deb-test-deps-systemd deb-test-deps-arm64

setup: system-packages $(STAMP) models/.complete

system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	        echo "installing $$missing"; \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	            --no-install-recommends $$missing >/dev/null; \
	    else \
	        echo "inferd needs these Debian packages: sudo apt-get install $$missing" >&2; \
	        exit 1; \
	    fi; \
	fi

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# pnnx (ONNX -> ncnn) without its dependencies: they would pull a 5.5 GB CUDA torch,
	# and the converter is a standalone binary inside the wheel
	$(PY) -m pip install --quiet --no-deps '$(PNNX)'
	touch $@

models/.complete: examples/demo_models.py $(wildcard examples/models/*/model.toml) $(wildcard examples/models/*/graph.toml) | $(STAMP)
	$(PY) examples/demo_models.py --dest models --cache .cache/wheels
	touch $@

run: setup
	@mkdir -p $(RUNDIR)/inferd
	@echo "inferd: serving $(SOCKET) with the demo models in ./models"
	@echo "try, in another shell:"
	@echo "  export INFERD_SOCKET=$(SOCKET)"
	@echo "  $(VENV)/bin/inferctl models"
	@echo "  $(PY) -c \"import numpy as np; from inferd.ipc import Client; print(Client().infer('ocr-cls', {'x': np.zeros((1,3,48,192), np.float32)}))\""
	exec $(VENV)/bin/inferd --config config/inferd.toml --socket $(SOCKET) --models models --preload ocr-cls

# pytest with bytecode caches on: where the environment sets PYTHONDONTWRITEBYTECODE,
# pytest rewrote every test module's asserts again on each run (~15 s of collection
# here) and every daemon, inferctl and client process a test starts compiled inferd
# again (~0.5 s each). The caches are __pycache__ folders, which git ignores.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q

# `make test` runs everything but the long repetitions marked `soak` (the 20 SIGTERM
# runs, the 100,000-message fuzz and soak), each of which it also runs at a smaller
# count; `make soak` runs those; CI runs both. `make test` and `make test-fast` spread
# the test files over TEST_JOBS processes (pytest-xdist, --dist loadfile: a file's tests
# stay in one process and in order, so a module's daemon serves all of them): one per
# core, at most 4. Run alone the suite kept ~1.1 of 2 cores busy (its tests mostly wait
# on daemons); TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST_JOBS := $(PYTEST) -n $(TEST_JOBS) --dist loadfile

test: setup libinferd
	$(PYTEST_JOBS) -m "not soak"

test-fast: setup libinferd
	$(PYTEST_JOBS) -m "not slow and not soak"

soak: setup libinferd
	$(PYTEST_JOBS) -m soak

# libinferd, the C client library (docs/libinferd.md): ipc/c/build/libinferd.so.0 and
# inferd.pc; its tests (tests/ipc/test_libinferd*.py) build its C test programs, plain and
# under ASan + UBSan, with the same Makefile.
libinferd:
	$(MAKE) -C ipc/c

# The RKNN simulator (rknn-toolkit2 2.5.0) in its own venv, for the rknn backend's
# simulator mode and `inferd-convert rknn` (docs/backends.md, "Out-of-process
# backends"). About 1.5 GB, 1.5 min. torch first, as the CPU build (`torch==2.13.0` is
# on this machine kind's disk; rknn-toolkit2's own pin would pull a CUDA build of
# several GB), then the toolkit's other requirements, then the toolkit with --no-deps.
VENV_RKNN := .venv-rknn
RKNN_STAMP := $(VENV_RKNN)/.installed
RKNN_TORCH ?= torch==2.13.0

venv-rknn: $(RKNN_STAMP)

$(RKNN_STAMP): packaging/rknn/simulator-requirements.txt
	test -x $(VENV_RKNN)/bin/python || $(PYTHON) -m venv $(VENV_RKNN)
	$(VENV_RKNN)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_RKNN)/bin/python -m pip install --quiet '$(RKNN_TORCH)'
	$(VENV_RKNN)/bin/python -m pip install --quiet -r packaging/rknn/simulator-requirements.txt
	$(VENV_RKNN)/bin/python -m pip install --quiet --no-deps rknn-toolkit2==2.5.0
	$(VENV_RKNN)/bin/python -c 'from rknn.api import RKNN'
	touch $@

# The simulator tests (also part of `make test`, where they skip without the venv).
test-rknn: setup venv-rknn
	INFERD_TEST_RKNN=1 $(PYTEST) -m rknn

lint: setup
	$(PY) -m pip install --quiet ruff mypy
	$(VENV)/bin/ruff check daemon ipc libbackends bench examples tests
	$(VENV)/bin/mypy daemon ipc libbackends
	@$(MAKE) --no-print-directory lint-duplicates

# Code copied within or between the source trees fails the lint (one piece of code should
# serve); runs alike in shape only (other names and values) are listed, not failed.
# `duplicates` (a command on PATH where the developers have it) is optional: without it
# the check is skipped, and says so.
DUPLICATE_TREES := daemon ipc libbackends
lint-duplicates:
	@if ! command -v duplicates >/dev/null 2>&1; then \
	    echo "lint: 'duplicates' is not on PATH: the copied-code check of" \
	         "$(DUPLICATE_TREES) is skipped"; \
	else \
	    out=$$(duplicates --most 200 --seconds 120); \
	    echo "$$out" | sed 's/^/duplicates: /'; \
	    copies=$$(echo "$$out" | grep -E '^D[0-9]+ ' | grep -v ' shape' \
	              | grep -E ' ($(subst $(eval) ,|,$(DUPLICATE_TREES)))/' || true); \
	    if [ -n "$$copies" ]; then \
	        echo "lint: code copied in $(DUPLICATE_TREES): make one piece of code serve" >&2; \
	        echo "$$copies" >&2; exit 1; \
	    fi; \
	fi

bench: setup
	$(PY) bench/run.py

# The example backends (docs/backends.md): examples/backends/build examples/customops/build/libelementwise_backend.so
# and custom ops (docs/customops.md): examples/customops/build/{cpu,gpu}/libinferdcst_*.so
examples:
	$(MAKE) -C examples/backends
	$(MAKE) -C examples/customops

# Debian packages inferd (all) and every add-on of packaging/backends/ with wheels for
# ARCH (amd64, this machine's, or arm64) in build/deb/$(ARCH)/ (docs/install.md). Rebuilt
# when a file of the source tree changed since the last build for that ARCH.
ARCH ?= $(shell dpkg --print-architecture 2>/dev/null || echo amd64)
DEB_SOURCES := $(shell git ls-files --cached --others --exclude-standard 2>/dev/null | \
                 while IFS= read -r f; do test -e "$$f" && echo "$$f"; done)

deb: build/deb/$(ARCH)/.built

# Its build dependencies first (before the venv, which needs python3-venv): installed when
# run as root, else the apt-get line is printed and make stops (packaging/build_deps.py).
build/deb/%/.built: $(DEB_SOURCES) | deb-build-deps-% $(STAMP)
	packaging/build-deb.sh $*
	touch $@

deb-build-deps-%:
	@$(PYTHON) packaging/build_deps.py $*

deb-test-deps deb-test-deps-systemd deb-test-deps-arm64:
	@$(PYTHON) packaging/build_deps.py --test $(subst -deps,,$@)
.SECONDARY: deb-build-deps-amd64 deb-build-deps-arm64

# A signed apt repository in build/apt/ of make deb's packages for APT_ARCHS (docs/install.md,
# "Installing from an apt repository"): GPG_KEY names the signing key in gpg's keyring.
# Older versions already in build/apt/pool stay (rm -rf build/apt to start over).
APT_ARCHS ?= amd64 arm64
apt-repo: $(APT_ARCHS:%=build/deb/%/.built)
	@test -n "$(GPG_KEY)" || { echo "make apt-repo: give the signing key: make apt-repo" \
	    "GPG_KEY=<key id or fingerprint> (a secret key in gpg's keyring)" >&2; exit 2; }
	APT_ARCHS="$(APT_ARCHS)" packaging/apt-repo.sh build/apt "$(GPG_KEY)" $(APT_ARCHS:%=build/deb/%)

# The onnxruntime-gpu wheel (x86_64, this Python) in .cache/wheels/onnxruntime-gpu/: the GPU
# backend's tests run it up to the hardware boundary (tests/libbackends/test_onnxruntime_gpu.py).
wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary :all: \
	    -d .cache/wheels/onnxruntime-gpu onnxruntime-gpu==1.31.1

# Needs root: builds, lints, installs, runs and purges the packages (tests/packaging/).
# What it needs on this machine first, as deb-test-systemd below.
deb-test: deb-test-deps deb models/.complete
	$(PY) tests/packaging/check_debs.py build/deb/$(ARCH) models

# Needs root: the amd64 packages in a Debian 12 container with systemd as PID 1. What it
# needs on this machine (mmdebstrap, systemd-nspawn, ...) comes first, installed when run
# as root, else the apt-get line is printed and make stops (packaging/build_deps.py).
deb-test-systemd: deb-test-deps-systemd build/deb/amd64/.built models/.complete
	$(PY) tests/packaging/check_systemd.py build/deb/amd64 models

# Needs root: the arm64 packages in an arm64 Debian 12 root under qemu-user, their
# results against the amd64 packages'. Its own packages first, as above (qemu-user-static,
# binfmt-support, the arm64 libraries...).
deb-test-arm64: deb-test-deps-arm64 build/deb/amd64/.built build/deb/arm64/.built \
                models/.complete
	lintian --fail-on error,warning build/deb/arm64/inferd_*_arm64.changes
	$(PY) tests/packaging/check_arm64.py build/deb models

clean:
	rm -rf $(VENV) $(VENV_RKNN) models .cache build *.egg-info examples/backends/build \
	  examples/customops/build ipc/c/build examples/c-client/build
