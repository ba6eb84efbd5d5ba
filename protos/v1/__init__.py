"""Generated protobuf and gRPC modules for ``shardps.v1``. Do not edit: run ``make protos``."""
