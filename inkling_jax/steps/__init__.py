"""Jitted serving steps (the device side of one step; see `program.py` for the data flow).

    batch.py     StepShape, StepBatch, RowPlan, pack_batch: what a step takes
    context.py   RowMeta, StepContext: the layer context over the serving state
    sampling.py  SamplingParams / SamplingArrays, the logits processors, sampling and speculative acceptance
    counts.py    the penalties' token-count table (ServingState.counts)
    draft.py     the MTP draft phase
    program.py   run_step / step_logits, compile_step
    decode_loop.py, verify_loop.py   K decode steps / R verify rounds in one dispatch (device loops)
    feed.py      feed_decode: a decode dispatch fed by the previous one's device outputs (overlap)
"""

from .batch import (DEFAULT_MAX_LOGIT_BIAS, DEFAULT_MAX_STOP_IDS, MODES, RowPlan, StepBatch, StepShape, check_batch,
                    pack_batch)
from .context import RowMeta, StepContext
from .feed import feed_decode
from .program import StepOutput, compile_lowered, compile_step, run_step, step_logits
from .sampling import accept_drafts, sample_tokens

__all__ = ["DEFAULT_MAX_LOGIT_BIAS", "DEFAULT_MAX_STOP_IDS", "MODES", "RowMeta", "RowPlan", "StepBatch", "StepContext",
           "StepOutput", "StepShape", "accept_drafts", "check_batch", "compile_lowered", "compile_step", "feed_decode",
           "pack_batch", "run_step", "sample_tokens", "step_logits"]
