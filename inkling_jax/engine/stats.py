"""The engine's counters, typed: every writer names the field it counts (`Engine.stats()` still
returns the documented dict, with the runner's and the pool's figures beside them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EngineStats:
    steps: int = 0  # dispatches committed (a K-step decode dispatch is one)
    extend_steps: int = 0
    decode_steps: int = 0
    verify_steps: int = 0
    multi_round_verify_steps: int = 0  # verify dispatches in which some row ran more than one round
    verify_rows: int = 0  # request rows of verify rounds (a row that runs R rounds of a dispatch counts R)
    accepted_draft_tokens: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # verify rows that accepted depth d's draft
    generated_tokens: int = 0
    prompt_tokens: int = 0  # new prompt tokens submitted (a session turn's own tokens)
    prompt_tokens_computed: int = 0  # prompt positions the steps ran (cache hits and n-sample forks excluded)
    cache_hit_tokens: int = 0
    evicted_slots: int = 0
    evicted_pages: int = 0
    deferred: int = 0  # admissions that had to wait
    skipped_checkpoints: int = 0  # no slot was free for one
    overlapped_dispatches: int = 0
    resets: int = 0  # device state rebuilt from the host records
    failed_requests: int = 0  # finished with "error" (non-finite logits, an exception from a hook)

    def count_step(self, mode: str) -> None:
        self.steps += 1
        setattr(self, f"{mode}_steps", getattr(self, f"{mode}_steps") + 1)

    def count_verify_row(self, accepted: int) -> None:
        self.verify_rows += 1
        self.accepted_draft_tokens += accepted
        for d in range(accepted):
            self.accepted_at_depth[d] += 1

    def as_dict(self) -> dict:
        """The counters, plus the accept figures derived from them."""
        out = asdict(self)
        rows = self.verify_rows
        out["mean_accept_length"] = (self.accepted_draft_tokens + rows) / rows if rows else 0.0  # bonus included
        out["depth_acceptance"] = [a / rows if rows else 0.0 for a in out.pop("accepted_at_depth")]
        return out


@dataclass
class CompileStats:
    """The step programs an engine needed (`StepRunner.stats`; `Engine.stats()` merges them)."""

    compiles: int = 0  # step executables this engine needed (table and disk cache hits included)
    compile_seconds: float = 0.0  # waiting for steps not in the process's table (loads and compiles)
