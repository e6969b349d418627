"""GPU correctness checks: `gpu_check` (Pallas == jnp greedy outputs; speculative == plain)."""
