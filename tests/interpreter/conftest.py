"""These tests run the Triton kernels in Triton's CPU interpreter, which must be selected before
Triton is imported: ``TRITON_INTERPRET=1 python -m pytest tests/interpreter``. A plain run of the
suite collects them through ``tests/test_kernels_interpreter.py``, which starts that process."""

import os

collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["test_*.py"]
