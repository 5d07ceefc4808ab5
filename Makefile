# Two commands do all set-up on a fresh Debian 12 machine:
#   make demo   - the main job on a local lab cluster
#   make test   - every test (integration tests start a real Slurm)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := slurmctld slurmd slurm-client munge
STAMP := $(VENV)/.installed

.PHONY: setup system-packages test demo bench clean

setup: system-packages $(STAMP)

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

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -ra tests

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
