"""What the client and the daemon both speak, and nothing else: protobuf
messages to and from the shared types (convert), gRPC status codes to and
from tierd's errors (status), Put's and Get's chunk messages built and read
by hand (chunks), token ids cut out of a message's raw bytes (packed), and
the hand-over of engine memory descriptors over the socket (fds). It runs
in both processes, the engine's and the daemon's, and imports only the
layers below it."""
