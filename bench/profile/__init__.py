"""Where device time goes: `decode` (a compiled decode or extend step under the profiler) and
`engine` (the engine's decode loop under the profiler)."""
