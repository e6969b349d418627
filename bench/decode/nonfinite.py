"""What the per-row non-finite check costs a decode step (issue 35): the compiled decode step of
the bench model with the check (`steps.program.finite_rows`: an all-isfinite reduction over
each row's logits, `StepOutput.row_ok`) against the same step with the check replaced by a
constant, alternated in rounds.

    python -m bench.decode.nonfinite [--batches 1,32] [--contexts 1024] [--rounds 3] [--out FILE]
    python -m bench.decode.nonfinite --smoke      # tiny config on the CPU (jnp steps)

Each round times `--iters` synced steps of both variants (median per round); the table gives the
median over rounds and the difference. Setup, state and rows are bench.decode's.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from bench.common.helpers import Report, device_params, log, table
from bench.decode.setup import apply_jax_options, compile_all, compiled_step, decode_shape, make_setup, make_state, \
    parse_args
from bench.decode.runs import time_decode
from inkling_jax.steps import program


def main(argv=None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    rounds = 3
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        del argv[i:i + 2]
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    apply_jax_options(args)
    s = make_setup(args)
    if not args.batches and not s.smoke:
        s.batches = (1, 32)
    if not args.contexts and not s.smoke:
        s.contexts = (1024,)
    log(f"backend {jax.default_backend()}, {s.cfg.num_layers} layers, vocab {s.cfg.unpadded_vocab_size}, {s.dtype}")
    params = device_params(s.cfg, 0, s.dtype)
    ids, state = make_state(s)
    shapes = [decode_shape(s, b, c) for b in s.batches for c in s.contexts]
    real = program.finite_rows
    compiled = {}
    for check in (True, False):
        program.finite_rows = real if check else (lambda logits, upto=None: jnp.ones(logits.shape[0], bool))
        try:
            got = compile_all(s, params, state, [(shape, s.main_pallas) for shape in shapes], workers=1)
        finally:
            program.finite_rows = real
        compiled.update({(shape, check): compiled_step(got, shape, s.main_pallas) for shape in shapes})
    rng = np.random.RandomState(0)
    times: dict = {}
    for r in range(rounds):
        for shape in shapes:
            for check in (True, False):
                state, synced, _ = time_decode(s, compiled[(shape, check)], params, shape, state,
                                               shape.pages * s.page_size, ids, rng)
                times.setdefault((shape, check), []).append(synced)
        log(f"round {r + 1} of {rounds}")
    rows = []
    for shape in shapes:
        on = statistics.median(times[(shape, True)]) * 1e3
        off = statistics.median(times[(shape, False)]) * 1e3
        rows.append([shape.batch, shape.pages * s.page_size, f"{off:.4f}", f"{on:.4f}", f"{on - off:+.4f}",
                     f"{100 * (on - off) / off:+.2f} %"])
    text = table(["B", "context", "ms/step without", "ms/step with the check", "difference", "relative"], rows)
    Report(args.out).add(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
