"""Host-side policy costs (no device): eviction from the prefix cache."""
