#!/usr/bin/env python3
"""Regenerate mlxcluster/protocol/<name>_pb2*.py from every proto/<name>.proto.

Usage: python scripts/gen_proto.py [--check] [NAME.proto ...]
  --check  exit 1 (and say which file) if the committed code is out of date.
  NAME.proto  only these files of proto/ (default: all of them).
"""
import glob
import os
import sys
import tempfile

from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "proto")
OUT = os.path.join(ROOT, "mlxcluster", "protocol")


def protos(names=()) -> list:
    if names:
        return [os.path.splitext(os.path.basename(n))[0] for n in names]
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(PROTO_DIR, "*.proto")))


def outputs(stem: str) -> tuple:
    return (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py", f"{stem}_pb2.pyi")


def generate(out_dir: str, stem: str) -> None:
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main([
        "protoc", f"-I{PROTO_DIR}", f"-I{include}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
        os.path.join(PROTO_DIR, f"{stem}.proto"),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed on {stem}.proto with exit code {rc}")
    # grpc_tools emits an absolute import; make it package-relative.
    grpc_file = os.path.join(out_dir, f"{stem}_pb2_grpc.py")
    with open(grpc_file) as f:
        text = f.read()
    alias = stem.replace("_", "__") + "__pb2"
    text = text.replace(f"import {stem}_pb2 as {alias}", f"from . import {stem}_pb2 as {alias}")
    with open(grpc_file, "w") as f:
        f.write(text)


def main() -> int:
    args = sys.argv[1:]
    check = "--check" in args
    stems = protos([a for a in args if a != "--check"])
    if not stems:
        print(f"no .proto files in {PROTO_DIR}", file=sys.stderr)
        return 1
    if check:
        with tempfile.TemporaryDirectory() as tmp:
            for stem in stems:
                generate(tmp, stem)
                for name in outputs(stem):
                    target = os.path.join(OUT, name)
                    if not os.path.exists(target):
                        print(f"{name} is missing: run python scripts/gen_proto.py", file=sys.stderr)
                        return 1
                    with open(os.path.join(tmp, name)) as a, open(target) as b:
                        if a.read() != b.read():
                            print(f"{name} is out of date: run python scripts/gen_proto.py", file=sys.stderr)
                            return 1
        print(f"generated protocol code is up to date ({', '.join(s + '.proto' for s in stems)})")
        return 0
    for stem in stems:
        generate(OUT, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
