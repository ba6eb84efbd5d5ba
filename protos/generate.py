"""Generate the Python code for shardps's .proto files.

The generated modules are committed (``protos/v1/*_pb2.py`` and ``*_pb2.pyi``) so that a
fresh clone works without grpcio-tools; ``tests/test_protos.py`` regenerates into a temporary
folder and fails when a .proto and its committed code disagree. Run ``make protos`` after
editing a .proto.

No gRPC stubs or servicers (``*_pb2_grpc.py``) are generated: the services bind their
handlers generically by method name (``shardps.rpc.status.bind``) and the clients call
methods by path, so only the message classes are needed.

The .proto files import each other as ``shardps/protos/v1/<name>.proto`` (a virtual include
path mapped onto this folder), so the generated imports read ``from shardps.protos.v1 import``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
VIRTUAL_ROOT = "shardps/protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Generate ``*_pb2.py`` and ``*_pb2.pyi`` into ``out_dir/v1``.

    Returns the generated files. Raises RuntimeError with protoc's message on failure.
    """
    import importlib.resources

    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{VIRTUAL_ROOT}={PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
        ] + [f"{VIRTUAL_ROOT}/v1/{p.name}" for p in proto_files()]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {args}")
        produced = Path(tmp) / VIRTUAL_ROOT / "v1"
        (out_dir / "v1").mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted(produced.iterdir()):
            target = out_dir / "v1" / f.name
            shutil.copyfile(f, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output root (default: in place)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
