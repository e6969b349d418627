"""The serving engine: host policy (admission, checkpoints, scheduling) over a device runner."""

from .config import EngineConfig, SamplingParams
from .engine import Engine
from .records import Completion, Request, Resources, ScoreResult, Session, StreamDelta
from .requests import Requests
from .stats import EngineStats

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStats", "Request", "Requests", "Resources", "SamplingParams",
           "ScoreResult", "Session", "StreamDelta"]
