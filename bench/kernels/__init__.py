"""Kernel benchmarks: `kernels` (the Pallas arena / MoE kernels against their jnp references,
with `cases`, `timing` and `sweeps`), and the micro benchmarks `moe_micro`, `router_micro`,
`attention_micro`."""
