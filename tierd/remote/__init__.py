"""Remote backends: the protocol the core uses (backend.py), the registry
that opens one by URL scheme (registry.py), and the backends, each in a
module or package of its own that imports nothing of the daemon."""
