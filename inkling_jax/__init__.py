"""inkling-jax: a JAX/Pallas serving core and research library for Inkling."""

from .config import AttentionGeometry, InklingConfig
from .model import cast_params, check_params, forward, forward_hidden, init_params, mtp_forward, param_shapes

__all__ = [
    "InklingConfig", "AttentionGeometry",
    "init_params", "forward", "forward_hidden", "mtp_forward", "param_shapes", "check_params", "cast_params",
]
__version__ = "0.1.0"

from .parallel import ShardPlan, make_mesh  # noqa: E402

__all__ += ["make_mesh", "ShardPlan"]

from .weights import load_checkpoint, load_pretrained, save_checkpoint, save_pretrained  # noqa: E402

__all__ += ["load_pretrained", "save_pretrained", "save_checkpoint", "load_checkpoint"]

from .engine import Completion, Engine, EngineConfig, SamplingParams, ScoreResult, StreamDelta  # noqa: E402

__all__ += ["Engine", "EngineConfig", "SamplingParams", "Completion", "StreamDelta", "ScoreResult"]

from .programs import clear_executable_cache, clear_program_cache, patches as _first_sight  # noqa: E402

__all__ += ["clear_program_cache", "clear_executable_cache"]
_first_sight()  # the library's globals as imported: a later rebinding (a spy) keeps its own programs
