"""Value checks shared by the configs (`EngineConfig`, `SamplingParams`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def is_int(x: Any) -> bool:
    """An integer that is not a bool (numpy integers included)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x: Any) -> bool:
    """A finite real number that is not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)) \
        and math.isfinite(float(x))
