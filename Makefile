# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv with a
# Python >= 3.12 when it is missing, installs the package with its extras, then runs.
#   PYTHON=/path/to/python3.12 make test    picks the interpreter explicitly.

VENV ?= .venv
PYTHON ?= $(shell for p in python3.13 python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	&& { command -v $$p; break; }; done)
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found; run PYTHON=/path/to/python3.12 make ..." >&2; exit 2; }
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[megatron,cudnn,plot,io,test]'
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/python -m dsa_precision demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV)
