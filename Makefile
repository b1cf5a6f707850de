# inferd developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUNDIR ?= $(or $(XDG_RUNTIME_DIR),/tmp/inferd-$(shell id -u))
SOCKET ?= ipc://$(RUNDIR)/inferd/inferd.sock

# Debian packages the build and the tests need (libzmq3-dev: the C client example;
# fonts: the OCR tests render their images; pocl + OpenCL headers and loader: the
# OpenCL custom op example and its tests). Installed by `make setup` when run as root.
SYSTEM_PACKAGES := python3-venv gcc libc6-dev libzmq3-dev fonts-dejavu-core \
	pocl-opencl-icd ocl-icd-libopencl1 opencl-headers ocl-icd-opencl-dev

.PHONY: setup system-packages run test test-fast bench clean examples deb deb-test lint

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

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(PY) -m pip install --quiet ruff mypy
	$(VENV)/bin/ruff check daemon ipc libbackends bench examples tests
	$(VENV)/bin/mypy daemon ipc libbackends

bench: setup
	$(PY) bench/run.py

# The example backends (docs/backends.md): examples/backends/build examples/customops/build/libelementwise_backend.so
# and custom ops (docs/customops.md): examples/customops/build/{cpu,gpu}/libinferdcst_*.so
examples:
	$(MAKE) -C examples/backends
	$(MAKE) -C examples/customops

# Debian packages inferd (all) and inferd-backend-onnxruntime (this arch) in build/deb/.
deb: $(STAMP)
	packaging/build-deb.sh

# Needs root: builds, lints, installs, runs and purges the packages (tests/packaging/).
deb-test: deb models/.complete
	$(PY) tests/packaging/check_debs.py build/deb models

clean:
	rm -rf $(VENV) models .cache build *.egg-info examples/backends/build examples/customops/build
