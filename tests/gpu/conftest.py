import json
import os

import pytest


@pytest.fixture(scope="session")
def record():
    """Append a measured number to $DSA_PRECISION_REPORT (JSON lines) and print it."""
    path = os.environ.get("DSA_PRECISION_REPORT")

    def _record(name: str, **values):
        line = json.dumps({"test": name, **values})
        print(line)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return _record
