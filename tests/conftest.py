import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def real_model_path():
    """Path of the embedded SmolLM2-135M-Instruct GGUF (skips if not installed)."""
    from mlxcluster.model.loader import ModelError, default_model_path

    try:
        return default_model_path()
    except ModelError as exc:
        pytest.skip(f"real model unavailable: {exc}")
