"""A ``join`` node's dashboard over a node view (no cluster): what the page is given before and
without a formation, the model transfer, lost peers, and the chat box's answer when nothing is formed.
The page in a real browser against a formed cluster: ``tests/test_dashboard.py``."""

import socket
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from mlxcluster.cluster.dashboard import NodeDashboard


def _view(**kw):
    view = {"node_id": "n0", "cluster": "c", "address": "10.0.0.1:50051", "state": "idle", "error": "",
            "waiting": "1 of 3 nodes live (n0); waiting for 2 more (seen, not answering: n2)",
            "model": "m.gguf", "model_path": "/x/m.gguf", "model_digest": "d", "layers": "", "role": "",
            "formation": None, "peers": [], "fetch": None}
    view.update(kw)
    return view


class FakeDaemon:
    def __init__(self, view):
        self._view = view
        self.creds = None

    def view(self):
        return self._view


@pytest.fixture
def board():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    daemon = FakeDaemon(_view())
    dash = NodeDashboard(daemon, sock)
    with TestClient(dash.app()) as client:
        yield SimpleNamespace(daemon=daemon, client=client)
    sock.close()


def peer(nid, status, reason=""):
    return {"node_id": nid, "address": f"10.0.0.{nid[-1]}:50051", "status": status, "state": "idle",
            "reason": reason, "model_digest": "d", "layers": "", "role": "", "last_seen_s": 0.4}


def test_an_unformed_node_shows_itself_its_peers_and_what_it_waits_for(board):
    board.daemon._view = _view(peers=[peer("n1", "live"), peer("n2", "seen")],
                               fetch={"state": "fetching", "from": "n1", "done_bytes": 40, "total_bytes": 100,
                                      "bytes_per_s": 10, "error": ""})
    s = board.client.get("/dashboard/state").json()
    assert [(n["node_id"], n["status"], n["rank"], n["self"]) for n in s["nodes"]] == \
        [("n0", "live", None, True), ("n1", "live", None, False), ("n2", "seen", None, False)]
    assert s["waiting"].startswith("1 of 3 nodes live") and s["ranks"] == [] and s["world_size"] == 0
    assert s["fetch"]["done_bytes"] == 40 and s["model"] == "m" and s["group"]["status"] == "idle"
    metrics = board.client.get("/metrics").text
    assert 'mlxcluster_node_peers{status="live"} 1.0' in metrics
    assert "mlxcluster_node_model_fetch_bytes 40.0" in metrics and "mlxcluster_node_formed 0.0" in metrics
    assert board.client.get("/").headers["content-type"].startswith("text/html")


def test_a_lost_peer_is_drawn_lost_and_listed_once_among_the_errors(board):
    board.daemon._view = _view(peers=[peer("n1", "live")])
    assert board.client.get("/dashboard/state").json()["errors"] == []
    board.daemon._view = _view(peers=[peer("n1", "lost", "no heartbeat for 3.0 s")])
    for _ in range(2):  # a second snapshot adds no second entry
        s = board.client.get("/dashboard/state").json()
    assert [n["status"] for n in s["nodes"] if n["node_id"] == "n1"] == ["lost"]
    assert [e["message"] for e in s["errors"]] == ["node n1 lost: no heartbeat for 3.0 s"]


def test_members_get_their_ranks_from_the_formation(board):
    members = [{"rank": 0, "node_id": "n1", "address": "10.0.0.1"}, {"rank": 1, "node_id": "n0", "address": "x"}]
    board.daemon._view = _view(state="loading", formation={
        "formation_id": "f", "world_size": 2, "backend": "ring", "rank0_address": "10.0.0.1:1", "rank": 1,
        "layers": "", "members": members}, peers=[peer("n1", "live")])
    s = board.client.get("/dashboard/state").json()
    assert {n["node_id"]: n["rank"] for n in s["nodes"]} == {"n0": 1, "n1": 0}
    assert s["world_size"] == 2 and s["backend"] == "ring"


def test_the_chat_box_is_told_why_when_the_cluster_is_not_formed(board):
    r = board.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    err = r.json()["error"]
    assert err["message"].startswith("the cluster is not formed yet (waiting: 1 of 3 nodes live")
    assert err["code"] == "service_unavailable"
    r = board.client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
