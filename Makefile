# Both entry points create or reuse .venv and install everything from this repo's
# own files, so a fresh clone needs nothing installed by hand.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU wheel that lies on the dev/CI machines; pinned so pip never fetches a CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: venv test test-slow verify clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,eval]"
	touch $(STAMP)

venv: $(STAMP)

# Fast suite: everything but the `slow` and `gpu` markers (CPU, minutes).
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu" -q; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; exit $$rc

# Slow suite: 108K needle cell, longer GSM8K slices.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow" -q

# The main job on the embedded default model.
verify: $(STAMP)
	$(BIN)/k3verify all

clean-venv:
	rm -rf $(VENV)
