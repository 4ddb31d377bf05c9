# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv with a
# Python >= 3.12 when it is missing, installs the package with its extras, then runs.
#   PYTHON=/path/to/python3.12 make test    picks the interpreter explicitly.
#   make python                             prints the interpreter the targets would use.

VENV ?= .venv
STAMP := $(VENV)/.installed

# The interpreter: the first Python >= 3.12 among python3.12, python3.13 and python3 on PATH;
# else, when pyenv is on PATH, its python3.12 / python3.13 (`pyenv which`, which needs that
# version selected) or any 3.12+ version it has installed ($(pyenv root)/versions/3.1[2-9]*).
# Empty when there is none (the targets then say to set PYTHON=).
FIND_PYTHON := ok() { [ -x "$$1" ] && "$$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
	>/dev/null 2>&1; }; \
	for p in python3.12 python3.13 python3; do \
		p=$$(command -v $$p) && ok "$$p" && { echo "$$p"; exit 0; }; \
	done; \
	command -v pyenv >/dev/null 2>&1 || exit 0; \
	for p in "$$(pyenv which python3.12 2>/dev/null)" "$$(pyenv which python3.13 2>/dev/null)" \
		"$$(pyenv root)"/versions/3.1[2-9]*/bin/python3; do \
		ok "$$p" && { echo "$$p"; exit 0; }; \
	done; exit 0
PYTHON ?= $(shell $(FIND_PYTHON))

# Fails, saying what to do, unless $(PYTHON) names a Python >= 3.12.
CHECK_PYTHON = @test -n "$(PYTHON)" || { echo "make: no Python >= 3.12 found (tried python3.12, \
python3.13 and python3 on PATH, then pyenv's versions); install one, or name it: \
PYTHON=/path/to/python3.12 make $@" >&2; exit 2; }; \
	"$(PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || { \
	echo "make: PYTHON=$(PYTHON) is not a Python >= 3.12; name one: PYTHON=/path/to/python3.12 \
make $@" >&2; exit 2; }

.PHONY: demo test clean python

$(STAMP): pyproject.toml
	$(CHECK_PYTHON)
	@test -x $(VENV)/bin/python || "$(PYTHON)" -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[megatron,cudnn,plot,io,bridge,test]'
	$(VENV)/bin/python -m pip install --quiet --no-deps 'megatron-bridge==0.6.2'
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/python -m dsa_precision demo
	@echo "The commands of README.md run in this environment: . $(VENV)/bin/activate"

test: $(STAMP)
	$(VENV)/bin/python -m mypy
	$(VENV)/bin/python -m pytest -q

python:
	$(CHECK_PYTHON)
	@echo "$(PYTHON)"

clean:
	rm -rf $(VENV)
