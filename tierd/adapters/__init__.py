"""Engine adapters: turn an engine's own KV caches into tierd sessions and back."""
