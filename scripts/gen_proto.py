#!/usr/bin/env python3
"""Regenerate mlxcluster/control/mlxcluster_pb2*.py from proto/mlxcluster.proto.

Usage: python scripts/gen_proto.py [--check]
  --check  exit 1 (and say which file) if the committed code is out of date.
"""
import os
import sys
import tempfile

from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "mlxcluster", "control")
FILES = ("mlxcluster_pb2.py", "mlxcluster_pb2_grpc.py", "mlxcluster_pb2.pyi")


def generate(out_dir: str) -> None:
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main([
        "protoc", f"-I{os.path.join(ROOT, 'proto')}", f"-I{include}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
        os.path.join(ROOT, "proto", "mlxcluster.proto"),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    # grpc_tools emits an absolute import; make it package-relative.
    grpc_file = os.path.join(out_dir, "mlxcluster_pb2_grpc.py")
    with open(grpc_file) as f:
        text = f.read()
    text = text.replace("import mlxcluster_pb2 as mlxcluster__pb2", "from . import mlxcluster_pb2 as mlxcluster__pb2")
    with open(grpc_file, "w") as f:
        f.write(text)


def main() -> int:
    if "--check" in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            generate(tmp)
            for name in FILES:
                with open(os.path.join(tmp, name)) as a, open(os.path.join(OUT, name)) as b:
                    if a.read() != b.read():
                        print(f"{name} is out of date: run python scripts/gen_proto.py", file=sys.stderr)
                        return 1
        print("generated protocol code is up to date")
        return 0
    generate(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
