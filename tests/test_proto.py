import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_code_matches_proto():
    """mlxcluster/control/mlxcluster_pb2*.py are what grpcio-tools makes of proto/mlxcluster.proto."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_proto.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_frame_type_values_match_swift_cluster_msg_type():
    from mlxcluster.protocol import mlxcluster_pb2 as pb

    assert pb.FrameType.Value("PROMPT_TOKENS") == 0x08
    assert pb.FrameType.Value("STEP_TOKEN") == 0x09
    assert pb.FrameType.Value("SESSION_STOP") == 0x0A
