"""The store: sessions, snapshots, placement, durable index and lifecycle."""
