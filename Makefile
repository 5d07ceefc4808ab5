# Two commands do all set-up on a fresh Debian 12 machine:
#   make demo   - the main job on a local lab cluster
#   make test   - every test (integration tests start a real Slurm)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := slurmctld slurmd slurm-client munge
STAMP := $(VENV)/.installed
# Slurm 25.11, built from the upstream source vendored beside the project (never copied
# into it): Debian has no 25.11 and pyslurm exists only for 25.11. Its build needs a C
# compiler; pyslurm's also needs Python's headers.
SLURM_25_PREFIX ?= /opt/slurm-25.11
SLURM_25_SOURCE ?= $(abspath $(CURDIR)/../shared/vendor/slurm-25.11.7.tar.xz)
SLURM_25_BUILD_DEPS := build-essential python3-dev xz-utils libmunge-dev libjson-c-dev libyaml-dev liblua5.3-dev pkg-config

.PHONY: setup system-packages slurm-25.11 pyslurm test demo bench clean
# The set-up's steps depend on each other in order (Debian's packages, then the venv, then
# pyslurm against the Slurm just built): `make -j` must not run them side by side.
.NOTPARALLEL:

setup: system-packages slurm-25.11 $(STAMP) pyslurm

# Slurm and munge from Debian; installed only when missing (needs root, as in CI).
system-packages:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c "import venv, ensurepip" 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing Debian packages:$$missing (run 'sudo make setup' once; Slurm tests are skipped until then)"; \
	  fi; \
	fi

# Built once into $(SLURM_25_PREFIX), never rebuilt when present. Installed through a staging
# directory and moved into place, so a failed build leaves no half prefix behind.
# --enable-multiple-slurmd: the lab runs one slurmd per node on one machine.
slurm-25.11:
	@if [ -x $(SLURM_25_PREFIX)/sbin/slurmctld ]; then exit 0; fi; \
	if [ ! -f "$(SLURM_25_SOURCE)" ]; then \
	  echo "warning: $(SLURM_25_SOURCE) not found: Slurm 25.11 is not built and its tests are skipped"; exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "Slurm 25.11 is not built (run 'sudo make slurm-25.11' once); its tests are skipped"; exit 0; fi; \
	set -e; start=$$(date +%s); \
	echo "building Slurm 25.11 into $(SLURM_25_PREFIX), once (about 10 minutes on 2 cores)"; \
	( cd "$$(dirname "$(SLURM_25_SOURCE)")" && sha256sum --quiet -c "$$(basename "$(SLURM_25_SOURCE)").sha256" ); \
	missing=""; for p in $(SLURM_25_BUILD_DEPS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi; \
	build=$$(mktemp -d /tmp/slurm-25.11-build.XXXXXX); \
	tar xf "$(SLURM_25_SOURCE)" -C $$build; src=$$(ls -d $$build/slurm-25.11*/); \
	step() { log=$$build/$$1.log; shift; if ! (cd $$src && "$$@") >$$log 2>&1; then \
	  tail -30 $$log; echo "Slurm 25.11 build failed; the log is $$log"; exit 1; fi; }; \
	step configure ./configure --prefix=$(SLURM_25_PREFIX) --sysconfdir=$(SLURM_25_PREFIX)/etc \
	  --disable-debug --enable-multiple-slurmd; \
	step make make -j$$(nproc); \
	step install make install DESTDIR=$$build/stage; \
	mkdir -p $$(dirname $(SLURM_25_PREFIX)); mv $$build/stage$(SLURM_25_PREFIX) $(SLURM_25_PREFIX); \
	rm -rf $$build; echo "Slurm 25.11 built into $(SLURM_25_PREFIX) in $$(( $$(date +%s) - start )) s"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The pyslurm backend's extra, built against the Slurm 25.11 prefix (about 3 minutes, once).
pyslurm: $(STAMP)
	@if [ ! -x $(SLURM_25_PREFIX)/sbin/slurmctld ]; then \
	  echo "pyslurm is not installed: no Slurm 25.11 in $(SLURM_25_PREFIX)"; exit 0; fi; \
	if $(PY) -m pip show -q pyslurm >/dev/null 2>&1; then exit 0; fi; \
	echo "building pyslurm against $(SLURM_25_PREFIX), once (about 3 minutes)"; \
	SLURM_INCLUDE_DIR=$(SLURM_25_PREFIX)/include SLURM_LIB_DIR=$(SLURM_25_PREFIX)/lib \
	  $(PY) -m pip install -q -e '.[pyslurm]'

# Every test on Debian's Slurm 22.05, then the Slurm integration tests once more on
# Slurm 25.11 with each backend (when 25.11 is built). The long lab scenarios (marker
# `scenario`, about 6 minutes) run there once, with pyslurm: the CLI backend's calls on
# 25.11 are made by the shorter tests.
test: setup
	$(PY) -m pytest -q -ra tests
	@if [ -x $(SLURM_25_PREFIX)/sbin/slurmctld ]; then \
	  for backend in cli pyslurm; do \
	    echo "== the Slurm integration tests on Slurm 25.11, $$backend backend =="; \
	    select="slurm"; [ $$backend = pyslurm ] || select="slurm and not scenario"; \
	    SLURM_EXT_SLURM_PREFIX=$(SLURM_25_PREFIX) SLURM_EXT_SLURM_BACKEND=$$backend \
	      $(PY) -m pytest -q -ra -m "$$select" tests || exit 1; \
	  done; \
	else echo "Slurm 25.11 is not built: its integration tests did not run"; fi

demo: setup
	$(PY) -m slurm_ext.demo

# Benchmarks that need no Slurm; daemon_cycle.py (root, the lab) and policy_scale.py run on their own.
bench: setup
	$(PY) benchmarks/estimator_accuracy.py
	$(PY) benchmarks/estimate_speed.py
	$(PY) benchmarks/tuner_pruning.py
	$(PY) benchmarks/compile_time.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
