import os

import numpy as np
import pytest

from helpers.s3_server import s3_bucket, s3_server  # noqa: F401  (fixtures)

os.environ.setdefault("STREAMFORGE_NO_PROGRESS", "1")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
