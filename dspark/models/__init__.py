"""Models: the target transformer, its paged KV cache, loader and runner."""
