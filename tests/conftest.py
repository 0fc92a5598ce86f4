import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO / "code"))

# The test models are tiny: extra threads only add synchronisation overhead (and thrash on a busy machine).
torch.set_num_threads(1)


@pytest.fixture
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"needs the project's shared data folder at {SHARED} (absent here)")
    return SHARED
