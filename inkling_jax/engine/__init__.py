"""The serving engine: host policy (admission, checkpoints, scheduling) over a device runner."""

from .config import EngineConfig, SamplingParams
from .engine import Engine
from .records import Completion, Request, Resources, Session

__all__ = ["Completion", "Engine", "EngineConfig", "Request", "Resources", "SamplingParams", "Session"]
