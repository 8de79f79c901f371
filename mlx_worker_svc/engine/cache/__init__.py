"""KV caches: the persistent decode batch and the prefix cache."""
