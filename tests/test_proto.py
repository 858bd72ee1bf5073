import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_code_matches_proto():
    """mlxcluster/control/mlxcluster_pb2*.py are what grpcio-tools makes of proto/mlxcluster.proto."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_proto.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_the_swift_apps_frame_numbers_are_reserved_never_reused():
    """0x08..0x0A (the Swift app's promptTokens, stepToken, sessionStop) and 0x0B/0x0C are parts of the
    one step plan (0x0D) now: their numbers stay reserved, so an old peer's frame is never read as
    something else."""
    from google.protobuf import descriptor_pb2

    from mlxcluster.protocol import mlxcluster_pb2 as pb

    file = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    enum = next(e for e in file.enum_type if e.name == "FrameType")
    assert [(r.start, r.end) for r in enum.reserved_range] == [(8, 12)]  # inclusive end
    assert {"PROMPT_TOKENS", "STEP_TOKEN", "SESSION_STOP"} <= set(enum.reserved_name)
    assert pb.FrameType.Value("STEP_PLAN") == 0x0D
