"""Sampling: a request's settings (`SamplingParams`), the per-row arrays a step takes
(`SamplingArrays`, packed from them in one place), the logits processors, and sampling and
speculative acceptance inside the step.

Keys are `fold_in(key(seed), position)`: a request's draws depend on its seed and positions
only, never on what it is batched with.

The logits processors, in the order they apply (per row, its own values; all of them under one
`lax.cond`, so a batch without any costs one predicate, and a row whose values are neutral
keeps its logits bit for bit):

    logit_bias          logits[t] += bias                       a sparse map (`max_logit_bias` entries)
    min_tokens          the row's stop ids (eos included) -inf  while fewer tokens were generated
    repetition_penalty  seen token: logit / p if > 0 else * p   HF: prompt (session history too) + output
    frequency_penalty   logit -= f * (times in the output)      OpenAI / vLLM: output tokens only
    presence_penalty    logit -= p * (in the output at all)
    temperature, then top_k, top_p and min_p, each judging the temperature-scaled distribution
    (a token must pass all three; min_p: p >= min_p * p_max)

Greedy rows take the argmax of the processed logits; speculative acceptance compares drafts
with the processed distributions (greedy and sampled). The log-probs a step reports (the
chosen tokens', their top alternatives, prompt log-probs) are the model's: log-softmax of the
raw logits, as vLLM and HF report them.

Counts for the penalties live in the device state (`ServingState.counts`, `steps/counts.py`):
a row of the table per running request (`SamplingArrays.count_row`). Verify position i reads
the row plus the drafts before it (as if accepted); a step adds what it emitted.

Adding a sampling option: a field of `SamplingParams` (validated in `validate`), its array in
`SamplingArrays` (`empty` and `pack`), and its use below (`process_logits` for a logits
processor); values are arrays, so a new value compiles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..validate import is_int, is_real

# OpenAI's range for presence / frequency penalties (negative values reward repetition)
PENALTY_RANGE = (-2.0, 2.0)


# no_type_check (the tests' jaxtyping hook): __post_init__ normalises what the API accepts beyond
# the annotations and raises the ValueErrors it promises for the rest
@no_type_check
@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True  # stop after the model's eos token
    stop_token_ids: tuple[int, ...] = ()  # further tokens that end a generation (kept in the output)
    n: int = 1  # samples of each prompt (sample j draws as a request with seed + j; one prefill shared)
    min_p: float = 0.0  # 0: off; else keep tokens with p >= min_p * p_max
    repetition_penalty: float = 1.0  # 1: off; > 1 discourages tokens of the prompt and the output (HF)
    presence_penalty: float = 0.0  # OpenAI / vLLM, in [-2, 2]: subtracted once from tokens in the output
    frequency_penalty: float = 0.0  # OpenAI / vLLM, in [-2, 2]: subtracted per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # {token id: bias} (a dict is accepted), added to the logits
    min_tokens: int = 0  # stop ids (eos included) and stop strings are ignored until this many tokens
    logprobs: int = 0  # top alternatives (token, log-prob) reported for each generated token
    prompt_logprobs: int | None = None  # None: off; k: the prompt's log-probs (from its 2nd token) and top k
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded text (needs the engine's tokenizer)
    include_stop_str: bool = False  # keep the matched stop string at the end of the text

    def __post_init__(self):
        stops = self.stop_token_ids
        if isinstance(stops, np.ndarray):
            stops = stops.tolist()
        if not isinstance(stops, (list, tuple)) or not all(is_int(t) for t in stops):
            raise ValueError(f"SamplingParams: stop_token_ids must be a sequence of int token ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = list(bias.items())
        try:
            pairs = [(k, v) for k, v in bias]
        except (TypeError, ValueError):
            raise ValueError(f"SamplingParams: logit_bias must be a dict {{token id: bias}}, got {bias!r}") from None
        if not all(is_int(k) and is_real(v) for k, v in pairs):
            raise ValueError(f"SamplingParams: logit_bias must map int token ids to finite numbers, got {bias!r}")
        if len({int(k) for k, _ in pairs}) != len(pairs):
            raise ValueError(f"SamplingParams: logit_bias names a token twice: {bias!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in pairs)))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise ValueError(f"SamplingParams: stop must be a string or a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is not usable."""
        def need(cond, msg):
            if not cond:
                raise ValueError(f"SamplingParams: {msg}")

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
             f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        need(is_real(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}")
        need(is_int(self.top_k) and self.top_k >= 0, f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        need(is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be a number in (0, 1], got {self.top_p!r}")
        need(is_int(self.seed), f"seed must be an int, got {self.seed!r}")
        need(isinstance(self.stop_at_eos, bool), f"stop_at_eos must be True or False, got {self.stop_at_eos!r}")
        need(all(t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        need(is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        need(is_real(self.min_p) and 0 <= self.min_p <= 1,
             f"min_p must be a number in [0, 1] (0: off), got {self.min_p!r}")
        need(is_real(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty!r}")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(is_real(value) and lo <= value <= hi, f"{name} must be a number in [{lo:g}, {hi:g}] (0: off), "
                 f"got {value!r}")
        need(all(t >= 0 for t, _ in self.logit_bias), f"logit_bias token ids must be >= 0, got {self.logit_bias}")
        need(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_new_tokens,
             f"min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens!r}")
        need(is_int(self.logprobs) and self.logprobs >= 0, f"logprobs must be an int >= 0, got {self.logprobs!r}")
        need(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
             f"prompt_logprobs must be None or an int >= 0, got {self.prompt_logprobs!r}")
        need(all(self.stop), f"stop strings must not be empty, got {self.stop!r}")
        need(isinstance(self.include_stop_str, bool),
             f"include_stop_str must be True or False, got {self.include_stop_str!r}")

    @property
    def penalized(self) -> bool:
        """A count-based penalty is on (the request needs a row of the count table)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


GREEDY = SamplingParams()  # RowPlan's default: greedy, no stop ids


# no_type_check (the tests' jaxtyping hook): a pytree node, rebuilt through __init__ by JAX with
# leaves of any kind (lowering's ArgInfo, specs, float0 cotangents; numpy on the host)
@no_type_check
@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    """Each row's sampling settings in a step (numpy on the host, device arrays inside the
    step): B rows, NS stop-id columns, NB logit-bias columns. Padded rows are greedy with no
    stop ids and no processors."""

    temperature: Float[Array, " b"]
    top_k: Int[Array, " b"]  # 0: off
    top_p: Float[Array, " b"]  # 1: off
    seed: Int[Array, " b"]  # per-request sampling seed (keys fold in the position)
    stop_ids: Int[Array, "b ns"]  # verify, multi-step decode, min_tokens: the row's stop tokens (-1: none)
    min_p: Float[Array, " b"]  # 0: off
    repetition_penalty: Float[Array, " b"]  # 1: off
    presence_penalty: Float[Array, " b"]  # 0: off
    frequency_penalty: Float[Array, " b"]  # 0: off
    bias_ids: Int[Array, "b nb"]  # logit_bias tokens (-1: none)
    bias_values: Float[Array, "b nb"]
    min_tokens: Int[Array, " b"]  # stop ids are suppressed while out_len < min_tokens
    out_len: Int[Array, " b"]  # tokens the row generated before this step (verify position i: + i)
    count_row: Int[Array, " b"]  # the row's row of the state's count table (0: the sink row, no counts)
    top_logprobs: Int[Array, " b"]  # top alternatives the row reports (0: none; the step computes them if any)
    prompt_top_logprobs: Int[Array, " b"]  # scoring steps: top alternatives at each prompt position (0: none)

    @staticmethod
    def empty(b: int, max_stop_ids: int, max_logit_bias: int = 0) -> "SamplingArrays":
        i32, f32 = (lambda *n: np.zeros(n, np.int32)), (lambda *n: np.zeros(n, np.float32))
        return SamplingArrays(temperature=f32(b), top_k=i32(b), top_p=np.ones(b, np.float32), seed=i32(b),
                              stop_ids=np.full((b, max_stop_ids), -1, np.int32), min_p=f32(b),
                              repetition_penalty=np.ones(b, np.float32), presence_penalty=f32(b),
                              frequency_penalty=f32(b), bias_ids=np.full((b, max_logit_bias), -1, np.int32),
                              bias_values=f32(b, max_logit_bias), min_tokens=i32(b), out_len=i32(b),
                              count_row=i32(b), top_logprobs=i32(b), prompt_top_logprobs=i32(b))

    @staticmethod
    def pack(rows: Sequence[Any], b: int, max_stop_ids: int, max_logit_bias: int = 0) -> "SamplingArrays":
        """The arrays of `rows` (each with the attributes of a `steps.RowPlan`: `sampling`, its
        request's `seed`, `stop_ids` (eos resolved), `out_len`, `count_row`,
        `prompt_top_logprobs`), padded to b rows.
        ValueError when a row has more than max_stop_ids stop ids or max_logit_bias biases."""
        out = SamplingArrays.empty(b, max_stop_ids, max_logit_bias)
        for i, r in enumerate(rows):
            sp = r.sampling
            if len(r.stop_ids) > max_stop_ids:
                raise ValueError(f"row {i} has {len(r.stop_ids)} stop ids; the step holds {max_stop_ids}")
            if len(sp.logit_bias) > max_logit_bias:
                raise ValueError(f"row {i} has {len(sp.logit_bias)} logit_bias entries; "
                                 f"the step holds {max_logit_bias}")
            out.temperature[i] = sp.temperature
            out.top_k[i] = sp.top_k
            out.top_p[i] = sp.top_p
            out.seed[i] = r.seed
            out.stop_ids[i, :len(r.stop_ids)] = r.stop_ids
            out.min_p[i] = sp.min_p
            out.repetition_penalty[i] = sp.repetition_penalty
            out.presence_penalty[i] = sp.presence_penalty
            out.frequency_penalty[i] = sp.frequency_penalty
            for j, (tok, bias) in enumerate(sp.logit_bias):
                out.bias_ids[i, j], out.bias_values[i, j] = tok, bias
            out.min_tokens[i] = sp.min_tokens
            out.out_len[i] = r.out_len
            out.count_row[i] = r.count_row
            out.top_logprobs[i] = sp.logprobs
            out.prompt_top_logprobs[i] = r.prompt_top_logprobs
        return out


# ------------------------------------------------------------------ logits processors


def processing_needed(s: SamplingArrays, out_index: Array) -> Array:
    """Whether any row of the batch has a processor on (the `lax.cond` predicate)."""
    suppress = (out_index < s.min_tokens[:, None]) if out_index.ndim == 2 else (out_index < s.min_tokens)
    return (jnp.any(s.bias_ids >= 0) | jnp.any(suppress) | jnp.any(s.repetition_penalty != 1)
            | jnp.any(s.presence_penalty != 0) | jnp.any(s.frequency_penalty != 0))


def process_logits(logits: Float[Array, "b v"], s: SamplingArrays, counts: Int[Array, "b v"] | None,
                   out_index: Int[Array, " b"]) -> Float[Array, "b v"]:
    """The logits processors before temperature (module docstring), every row with its own
    values: `counts` are the rows' count-table rows (None: no count table, no count-based
    penalties), `out_index` the index among the row's generated tokens of the token these
    logits choose. Rows whose processors are neutral keep their logits exactly."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    out = logits.at[rows, jnp.where(s.bias_ids >= 0, s.bias_ids, v)].add(s.bias_values, mode="drop")
    suppress = (out_index < s.min_tokens)[:, None] & (s.stop_ids >= 0)
    out = out.at[rows, jnp.where(suppress, s.stop_ids, v)].set(-jnp.inf, mode="drop")
    if counts is not None:
        rep = s.repetition_penalty[:, None]
        seen = (counts > 0) & (rep != 1)
        out = jnp.where(seen, jnp.where(out < 0, out * rep, out / rep), out)
        n_out = (counts >> 1).astype(jnp.float32)
        freq, pres = s.frequency_penalty[:, None], s.presence_penalty[:, None]
        penalized = (freq != 0) | (pres != 0)
        out = jnp.where(penalized, out - freq * n_out - pres * (n_out > 0).astype(jnp.float32), out)
    return out


def processed(logits: Float[Array, "b ... v"], s: SamplingArrays, table: Array | None, out_index: Int[Array, "b ..."],
              drafts: Int[Array, "b s"] | None = None, then: Any = None) -> Any:
    """`process_logits` under one `lax.cond` (a batch with no processor on skips all of it,
    the count rows' gather included). `table`: the state's count table [R, V] (None: none).
    logits [B, V] with out_index [B], or a verify step's [B, S+1, V] with out_index [B, S+1]:
    position i counts `drafts[:, :i]` as generated (as if accepted). `then`: a function of the
    (processed) logits applied inside both branches (e.g. the argmax: on the CPU a
    conditional's [B, V] result costs far more than its [B] one)."""
    then = (lambda x: x) if then is None else then

    def run(x):
        base = None if table is None else table[s.count_row]
        if x.ndim == 2:
            return then(process_logits(x, s, base, out_index))
        outs, counts = [], base
        for i in range(x.shape[1]):
            if i and counts is not None:
                counts = counts + 2 * (drafts[:, i - 1, None] == jnp.arange(x.shape[-1])[None, :]).astype(jnp.int32)
            outs.append(process_logits(x[:, i], s, counts, out_index[:, i]))
        return then(jnp.stack(outs, axis=1))

    return jax.lax.cond(processing_needed(s, out_index), run, then, logits)


def top_alternatives(logits: Float[Array, "... v"], want: Int[Array, " b"], k: int) -> tuple[Array, Array]:
    """The k most likely tokens and their log-probs under the model (the raw logits' log-softmax,
    rounded as `jax.nn.log_softmax` rounds it) at each row ([..., k]; zeros when no row of the
    batch asks for any (`want`: alternatives each row asks for), or k == 0: skipped)."""
    shape = logits.shape[:-1] + (k,)
    if k == 0:
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    def top(x):
        values, ids = jax.lax.top_k(x, k)
        top_value = jnp.max(x, axis=-1, keepdims=True)
        shifted = x - jax.lax.stop_gradient(top_value)
        return ids.astype(jnp.int32), (values - top_value) - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))

    return jax.lax.cond(jnp.any(want > 0), top,
                        lambda x: (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)),
                        logits.astype(jnp.float32))


@jax.named_scope("sample")
def sample_tokens(logits: Float[Array, "b v"], sampling: SamplingArrays, position: Array,
                  counts: Array | None = None) -> tuple[Array, Array]:
    """Greedy where temperature == 0, else temperature / top-k / top-p / min-p sampling with the
    key fold_in(key(seed), position): reproducible for a request whatever it is batched with;
    both after the logits processors (`counts`: the state's count table, or None). Returns
    (tokens, their log-probs under the model)."""
    temperature, top_k, top_p, seed = sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = processed(logits, sampling, counts, sampling.out_len,
                       then=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))

    def sample(_):
        filt = filtered_logits(processed(logits, sampling, counts, sampling.out_len), temperature, top_k, top_p,
                               sampling.min_p)

        def draw(s, p, row):
            key = jax.random.fold_in(jax.random.key(s.astype(jnp.uint32)), p)
            return jax.random.categorical(key, row)

        sampled = jax.vmap(draw)(seed, position, filt).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # an all-greedy batch (the common case) skips the sort and the draws
    tokens = jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


@jax.named_scope("accept")
def accept_drafts(logits: Float[Array, "b s1 v"], drafts: Int[Array, "b s"], sampling: SamplingArrays,
                  max_accept: Int[Array, " b"], position: Int[Array, " b"],
                  counts: Array | None = None) -> tuple[Array, Array, Array, Array]:
    """Speculative acceptance for one verify step.

    logits[:, i] is the target at the row holding t_{p+i} (it predicts t_{p+i+1}); drafts[:, i]
    proposes t_{p+i+1}. Both rules judge the processed logits (position i as if drafts[:, :i]
    were accepted: the same logits plain decoding would process there). Greedy rows accept
    the longest prefix equal to the target's argmax
    and take the argmax after it (so the output is exactly greedy decoding). Sampled rows use
    the rejection rule with a greedy (point-mass) proposal: accept draft i with probability
    p_i(d_i); at the first rejection sample from p_i with d_i removed, renormalised; after S
    acceptances sample from p_S. The emitted tokens are distributed exactly as the target's
    samples. Acceptance stops at `max_accept` and after an accepted stop token (which then
    becomes the last token). Returns (num_accepted, bonus, bonus logprob, draft logprobs)."""
    b, s1, v = logits.shape
    s = s1 - 1
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    draft_logp = jnp.take_along_axis(logp[:, :s], drafts[:, :, None], axis=-1)[..., 0]  # [B, S]
    proc = processed(logits, sampling, counts, sampling.out_len[:, None] + jnp.arange(s1)[None, :], drafts)
    greedy = jnp.argmax(proc, axis=-1).astype(jnp.int32)  # [B, S+1]
    temp = sampling.temperature
    rows = jnp.arange(b)
    greedy_ok = drafts == greedy[:, :s]

    def accepted(ok):
        return jnp.minimum(jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), max_accept)

    def with_sampled_rows(_):
        """Both rules: the filtered distributions (a sort over the vocabulary per position), the
        draws; then the token after the accepted drafts."""
        filt = jax.vmap(filtered_logits, in_axes=(1, None, None, None, None), out_axes=1)(
            proc, temp, sampling.top_k, sampling.top_p, sampling.min_p)  # [B, S+1, V] filtered, temperature-scaled
        probs = jax.nn.softmax(filt, axis=-1)
        p_draft = jnp.take_along_axis(probs[:, :s], drafts[:, :, None], axis=-1)[..., 0]  # [B, S]
        keys = jax.vmap(lambda sd, pos: jax.random.fold_in(jax.random.key(sd.astype(jnp.uint32)), pos))(
            sampling.seed, position)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1 << 20), (s,)))(keys)  # [B, S]
        n_acc = accepted(jnp.where((temp > 0)[:, None], u < p_draft, greedy_ok))
        row_filt = filt[rows, n_acc]  # [B, V]
        rejected = jnp.where(n_acc < s, drafts[rows, jnp.minimum(n_acc, s - 1)], -1)
        residual = jnp.where(jnp.arange(v)[None, :] == rejected[:, None], -jnp.inf, row_filt)
        # a rejected draft held all the mass (p = 1): nothing left; fall back to the filtered row
        residual = jnp.where(jnp.any(jnp.isfinite(residual), axis=-1, keepdims=True), residual, row_filt)
        sampled = jax.vmap(lambda k, a, l: jax.random.categorical(jax.random.fold_in(k, a), l))(keys, n_acc, residual)
        return n_acc, jnp.where(temp > 0, sampled.astype(jnp.int32), greedy[rows, n_acc])

    def greedy_rows(_):
        n_acc = accepted(greedy_ok)
        return n_acc, greedy[rows, n_acc]

    # an all-greedy batch (the common case) skips the sorts and the draws, as sample_tokens does
    n_acc, bonus = jax.lax.cond(jnp.any(temp > 0), with_sampled_rows, greedy_rows, None)

    # an accepted stop token ends the row: it becomes the last token
    stop_ids = sampling.stop_ids
    is_stop = jnp.any(drafts[:, :, None] == stop_ids[:, None, :], axis=-1) & (stop_ids >= 0).any(-1)[:, None]
    first_stop = jnp.argmax(is_stop, axis=1)
    stop_hit = jnp.any(is_stop, axis=1) & (first_stop < n_acc)
    bonus = jnp.where(stop_hit, drafts[rows, first_stop], bonus)
    n_acc = jnp.where(stop_hit, first_stop, n_acc)
    bonus_logp = logp[rows, n_acc, bonus]
    return n_acc.astype(jnp.int32), bonus, bonus_logp, draft_logp


def filtered_logits(logits: Array, temperature: Array, top_k: Array, top_p: Array, min_p: Array | None = None) -> Array:
    """Temperature-scaled logits with top-k / top-p / min-p truncation (-inf outside), per row;
    each judges the scaled distribution, a token must pass all three."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(v)[None, :]
    keep_sorted = (rank < jnp.where(top_k > 0, top_k, v)[:, None]) & (cum_before < top_p[:, None])
    if min_p is not None:
        keep_sorted &= (probs >= min_p[:, None] * probs[:, :1]) | (min_p[:, None] <= 0)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, scaled, -jnp.inf)
