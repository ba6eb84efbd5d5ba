"""shardps wire contract (package ``shardps.v1``): the .proto files and their generated code."""
