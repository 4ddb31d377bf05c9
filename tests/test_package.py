import subprocess
import sys

import dsa_precision


def test_imports_without_megatron_cudnn_or_gpu():
    code = (
        "import sys\n"
        "for name in ('megatron', 'megatron.core', 'cudnn', 'transformer_engine', 'flash_mla', 'triton'):\n"
        "    sys.modules[name] = None  # any import of these now raises ImportError\n"
        "import dsa_precision\n"
        "print(sorted(dsa_precision.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "indexer_scores" in out.stdout


def test_public_surface():
    for name in dsa_precision.__all__:
        assert getattr(dsa_precision, name) is not None
