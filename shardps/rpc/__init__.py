"""gRPC transport helpers shared by every process: codecs, status mapping, channels, metrics."""
