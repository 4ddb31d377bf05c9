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


@pytest.fixture(scope="session")
def megatron_parallel_gpu():
    """One NCCL process group (one rank) and Megatron's model-parallel state (TP = PP = 1) for
    the GPU tests that build Megatron modules."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return parallel_state
