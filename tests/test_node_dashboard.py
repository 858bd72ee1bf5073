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


# -- defect 8: several nodes on one host, one dashboard each ------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nodes_on_one_host_each_get_a_dashboard_port():
    """Three ``join`` nodes on one host, default port: each gets its own listening port (the first
    the default, the others the next free ones); before the fix the second and third bound the
    default too (``SO_REUSEADDR``, nobody listening yet) and died in uvicorn's ``listen`` with
    ``Errno 98``."""
    from mlxcluster.cluster.dashboard import bind

    default = _free_port()
    socks = [bind("127.0.0.1", None, default=default, tries=10) for _ in range(3)]
    try:
        ports = [s.getsockname()[1] for s in socks]
        assert ports[0] == default and len(set(ports)) == 3, ports
        for port in ports:  # each one listens at once: the port is its own
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        # the default range exhausted: any free port
        last = bind("127.0.0.1", None, default=default, tries=1)
        assert last.getsockname()[1] not in ports
        last.close()
        # a port given explicitly that is taken: one line, no fallback
        with pytest.raises(OSError) as info:
            bind("127.0.0.1", ports[1])
        assert str(info.value) == f"cannot listen on 127.0.0.1:{ports[1]} for the dashboard: Address already in use"
    finally:
        for s in socks:
            s.close()


def test_the_url_logged_is_the_port_bound(caplog):
    from mlxcluster.cluster.dashboard import bind

    default = _free_port()
    first = bind("127.0.0.1", None, default=default)
    second = bind("127.0.0.1", None, default=default)
    try:
        dash = NodeDashboard(FakeDaemon(_view()), second)
        assert dash.url == f"http://127.0.0.1:{second.getsockname()[1]}/" != f"http://127.0.0.1:{default}/"
        assert NodeDashboard(FakeDaemon(_view()), first, tls=("c", "k")).url == f"https://127.0.0.1:{default}/"
    finally:
        first.close()
        second.close()


# -- API keys -----------------------------------------------------------------------------------------------
def test_a_node_dashboard_with_keys_refuses_without_one_and_signs_the_page_in():
    from mlxcluster.front.auth import KeyRing, key_id

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dash = NodeDashboard(FakeDaemon(_view()), sock, auth=KeyRing(["node-key-1"]))
    try:
        with TestClient(dash.app()) as c:
            for method, path in (("GET", "/"), ("GET", "/dashboard/state"), ("GET", "/dashboard/events"),
                                 ("GET", "/metrics"), ("POST", "/v1/chat/completions")):
                r = c.request(method, path, json={"messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
                assert c.request(method, path, headers={"x-api-key": "wrong"}).status_code == 401, path
            assert c.get("/dashboard/state", headers={"Authorization": "Bearer node-key-1"}).json()["node_id"] == "n0"
            r = c.post("/v1/chat/completions", headers={"x-api-key": "node-key-1"},
                       json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503  # past the key: the cluster is not formed
            page = c.get("/", headers={"accept": "text/html"})
            assert page.status_code == 401 and 'action="/dashboard/login"' in page.text
            assert c.post("/dashboard/login", data={"key": "node-key-1"}, follow_redirects=False).status_code == 303
            assert c.get("/").status_code == 200 and c.get("/dashboard/state").status_code == 200
            metrics = c.get("/metrics").text
            assert f'mlxcluster_api_key_requests_total{{key_id="{key_id("node-key-1")}"}}' in metrics
            assert "node-key-1" not in metrics
    finally:
        sock.close()


def test_join_with_a_taken_dashboard_port_is_one_line():
    """``join --dashboard-port P`` with P taken: one error line, exit 1, no traceback, before the
    node joins anything."""
    from harness import assert_one_line_error, cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = cli("join", "--cluster", "taken-port-test", "--interface", "127.0.0.1", "--dashboard-port", str(port),
                   env={"MLXCLUSTER_SECRET": "a-test-secret-0123"})
    assert proc.returncode == 1
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port} for the dashboard: Address already in use")


def test_speculative_decoding_figures_come_from_rank0s_info(board, monkeypatch):
    """The page's speculative figures (acceptance rate, tokens per step, the drafter) and /metrics'
    counters are rank 0's ``Info`` (``spec_*``, ``draft``, ``draft_tokens``); none before any draft."""
    from mlxcluster.protocol import mlxcluster_pb2 as pb

    info = pb.InfoReply(generated_tokens=50, draft="ngram", draft_tokens=4)

    async def refresh(self):
        self._info = info

    monkeypatch.setattr(NodeDashboard, "_refresh", refresh)
    spec = board.client.get("/dashboard/state").json()["speculative"]
    assert spec == {"draft": "ngram", "draft_tokens": 4, "drafted_tokens": 0, "acceptance_rate": None,
                    "tokens_per_step": None}
    info = pb.InfoReply(generated_tokens=90, draft="ngram", draft_tokens=4, spec_drafted_tokens=40,
                        spec_accepted_tokens=30, spec_steps=10, spec_emitted_tokens=40)
    spec = board.client.get("/dashboard/state").json()["speculative"]
    assert (spec["acceptance_rate"], spec["tokens_per_step"], spec["drafted_tokens"]) == (0.75, 4.0, 40)
    metrics = board.client.get("/metrics").text
    assert "mlxcluster_cluster_spec_drafted_tokens_total 40.0" in metrics
    assert "mlxcluster_cluster_spec_accepted_tokens_total 30.0" in metrics
    info = None  # rank 0 gone: no figures
    assert board.client.get("/dashboard/state").json()["speculative"] is None
