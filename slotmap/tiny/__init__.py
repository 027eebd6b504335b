"""A tiny decoder-only model, its paged KV caches, and the engine loop that drives it through a backend's pool."""
