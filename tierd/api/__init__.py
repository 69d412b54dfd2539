"""The gRPC API: a thin adapter from messages to the store."""
