# Two commands do all set-up on a fresh machine:
#   make demo   provision a local container p40-demo with site.yml and show it
#   make test   lint + the engine's unit tests + every molecule scenario
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV := $(CURDIR)/.venv
export PATH := $(VENV)/bin:$(PATH)
export OLDGPU_CACHE ?= /var/cache/oldgpu
export ANSIBLE_FORCE_VALID_GROUP_NAMES := ignore
PODMAN_ENV := source scripts/podman-env.sh
# Every scenario. The fleet's three hosts start from the image of the jobs
# scenario's converged host (molecule/fleet/image.sh): scripts/molecule-all.sh runs
# jobs then default in one lane, nvidia, trixie, then the fleet (once that image is ready) in
# the other (OLDGPU_MOLECULE_LANES=1 runs them one after another).
SCENARIOS ?= $(patsubst molecule/%/molecule.yml,%,$(wildcard molecule/*/molecule.yml))

.PHONY: help host-packages bootstrap image prepare lint unit nix molecule test demo demo-destroy lock clean

help:
	@echo "make demo | make test | make lint | make unit | make nix | make prepare | make molecule SCENARIOS=default"

# What the controller itself needs from the distribution (Debian/Ubuntu).
host-packages:
	@scripts/host-packages.sh

bootstrap: host-packages
	@scripts/bootstrap-controller.sh

image: bootstrap
	@scripts/build-test-image.sh
	@OLDGPU_TEST_SUITE=trixie scripts/build-test-image.sh

lint: bootstrap
	ansible-lint
	yamllint --strict .
	ruff check .
	ruff format --check .

# vllm.lock's wheels too: tests/test_vllm_env.py builds the V100/T4 hosts' venv from them.
unit: bootstrap
	@scripts/wheelhouse.sh files/requirements/vllm.lock
	@venv=$$(scripts/engine-venv.sh) && VERL09_VENV=$$(scripts/engine-venv.sh $(VERL09_TEST_VENV)) && \
	  export VERL09_VENV && cd $(CURDIR) && \
	  "$$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests

# The flake, offline: every .nix file parsed, the outputs evaluated (and the
# module's env file and unit built) against the stub nixpkgs in tests/nix.
nix: bootstrap
	@scripts/nix-checks.sh

# The newer verl releases' default-index locks (their cu118 locks come from PyTorch's index).
# verl 0.9.0's CPU tests (tests/test_rollout_verl09.py ...): the release's lock, as a test venv.
VERL09_TEST_VENV := files/requirements/verl-0.9.0.lock verl09
RELEASE_LOCKS := $(filter-out %-cu118.lock,$(wildcard files/requirements/verl-*.lock))

# Scenarios mount the shared wheelhouse (the locks' wheels, the newer releases' sdists)
# and the local verl mirror.
molecule: image
	@scripts/wheelhouse.sh
	@for lock in $(RELEASE_LOCKS); do scripts/wheelhouse.sh "$$lock"; done
	@scripts/verl-sdists.sh
	@scripts/cuda-wheels.sh
	@scripts/verl-mirror.sh >/dev/null
	@$(PODMAN_ENV) && scripts/molecule-all.sh $(SCENARIOS)

# What unit and molecule fetch or build (the image, the wheelhouse for every lock and
# the newer releases' sdists, the engine's venv, the verl mirror), made once before they run side by side. On a
# fresh machine the image's debootstrap and the verl mirror run beside the downloads
# (each is a no-op once its stamp or label is current).
prepare: bootstrap
	@(scripts/build-test-image.sh && OLDGPU_TEST_SUITE=trixie scripts/build-test-image.sh) & image=$$!; \
	scripts/verl-mirror.sh >/dev/null & mirror=$$!; \
	if scripts/wheelhouse.sh && scripts/wheelhouse.sh files/requirements/vllm.lock && \
	  (for lock in $(RELEASE_LOCKS); do scripts/wheelhouse.sh "$$lock" || exit 1; done) && \
	  scripts/verl-sdists.sh && scripts/cuda-wheels.sh && scripts/engine-venv.sh >/dev/null && \
	  scripts/engine-venv.sh $(VERL09_TEST_VENV) >/dev/null; then rc=0; else rc=1; fi; \
	wait $$image || rc=1; wait $$mirror || rc=1; exit $$rc

# Each stage timed (scripts/test-stages.sh prints a table at the end). unit+molecule:
# the unit tests (one process) run beside the scenarios, not before them.
test:
	@scripts/test-stages.sh lint nix prepare unit+molecule
	@echo "make test: all checks passed"

demo: image
	@$(PODMAN_ENV) && scripts/demo.sh

demo-destroy:
	@$(PODMAN_ENV) && podman rm -f p40-demo

lock:
	@scripts/lock.sh

clean:
	rm -rf .venv .collections
