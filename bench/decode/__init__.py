"""Decode benchmarks: `decode` (the compiled steps against the HBM roofline, prefill, HF
transformers; with `setup`, `runs` and `hf`) and `ab_decode` (side-by-side decode timing of
source trees)."""
