"""The committed generated code matches the .proto files, and reflection tells the truth."""

import filecmp
from pathlib import Path

import grpc
import pytest

from shardps.protos import generate


def test_generated_code_matches_protos(tmp_path):
    generate.generate(tmp_path)
    committed = Path(generate.PROTO_DIR) / "v1"
    fresh = sorted((tmp_path / "v1").iterdir())
    assert fresh, "protoc produced nothing"
    stale = [f.name for f in fresh if not filecmp.cmp(f, committed / f.name, shallow=False)]
    assert not stale, f"generated code is stale for {stale}: run `make protos` and commit"
    leftover = sorted({f.name for f in committed.glob("*_pb2*")} - {f.name for f in fresh})
    assert not leftover, f"{leftover} are no longer generated (protos/generate.py): delete them"


def test_reflection_lists_services(cluster):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    for address, service in [(cluster.address, "shardps.v1.ResourceManager"),
                             (next(iter(cluster.servers.values())).address, "shardps.v1.ParameterServer")]:
        with grpc.insecure_channel(address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name for s in next(responses).list_services_response.service]
        assert service in names and "grpc.health.v1.Health" in names


def test_chunk_codec_is_plain_protobuf():
    """Hand-written chunks parse with the generated classes, and back."""
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc.codec import decode_chunk, encode_chunk
    header = ps.PushHeader(payload_bytes=5)
    raw = encode_chunk(header.SerializeToString(), b"hello")
    msg = ps.PushChunk.FromString(raw)
    assert msg.header == header and msg.data == b"hello"
    chunk = decode_chunk(msg.SerializeToString())
    assert chunk.parse_header(ps.PushHeader) == header and bytes(chunk.data) == b"hello"


@pytest.mark.parametrize("raw", [b"\x0a\xff", b"\x12\x05abc", b"\x0b", b"\x12\x80"])
def test_chunk_codec_rejects_malformed(raw):
    from shardps.errors import InvalidArgument
    from shardps.rpc.codec import decode_chunk
    with pytest.raises(InvalidArgument):
        decode_chunk(raw)


def test_payloads_of_empty_and_strided_arrays():
    import numpy as np

    from shardps.rpc.codec import split_payload
    arrays = [np.empty((0, 4), np.float32), np.arange(12, dtype=np.float32).reshape(3, 4)[:, :2],
              np.arange(3, dtype=np.int64)]
    joined = b"".join(bytes(p) for p in split_payload(arrays, chunk_bytes=7))
    assert joined == np.arange(12, dtype=np.float32).reshape(3, 4)[:, :2].tobytes() + arrays[2].tobytes()
