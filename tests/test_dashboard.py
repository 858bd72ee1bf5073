"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium) against a real ``serve --world-size 3``.

The page loads with no console errors, shows 3 live ranks with their memory, charts the last 5 minutes
(tok/s, TTFT, queue depth, each rank's memory: inline SVG lines that gain a point per snapshot), the
chat box streams the same answer as the API, the tok/s figure moves while a request runs, and a
SIGKILLed rank turns the page red within the heartbeat timeout.  Screenshots (desktop 1280x800 and phone 390x844) are
saved under ``$MLXCLUSTER_ARTIFACTS`` (default ``artifacts/``).
"""

import json
import os
import shutil
import signal
import socket
import time
import urllib.parse

import httpx
import pytest

from harness import descendants, until
from test_healing import Serve, rank_pids

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
ARTIFACTS = os.environ.get("MLXCLUSTER_ARTIFACTS", os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                                                 "artifacts"))

NODE = shutil.which("node") or shutil.which("nodejs")

#: dashboard.js run by node against a stand-in for the page's elements: every snapshot line given on
#: stdin goes to the EventSource's onmessage (render); prints, per snapshot, each element's text by id
_FAKE_PAGE = r"""
const fs = require("fs"), vm = require("vm");
const elements = {};
const element = (id) => elements[id] || (elements[id] = {id, textContent: "", innerHTML: "", hidden: false,
  dataset: {}, tBodies: [{innerHTML: ""}], addEventListener() {}, removeAttribute() {}});
let source = null;
const context = {document: {getElementById: element}, console,
                 EventSource: function (url) { source = this; }, fetch: () => Promise.resolve({status: 200})};
vm.runInNewContext(fs.readFileSync(process.argv[1], "utf8"), context);
const out = [];
for (const line of fs.readFileSync(0, "utf8").split("\n").filter(Boolean)) {
  source.onmessage({data: line});
  out.push(Object.fromEntries(Object.entries(elements).map(([id, el]) => [id, el.textContent])));
}
process.stdout.write(JSON.stringify(out));
"""


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_window_size(1280, 800)
    yield driver
    driver.quit()


def _js(driver, script):
    return driver.execute_script(script)


def _wait(driver, script, what, timeout=60):
    """Poll ``script`` (returns a truthy value when the page is there) until ``timeout``."""
    return until(lambda: _js(driver, script), timeout, what)


def _chat(browser, prompt, max_tokens):
    """Ask through the page's chat box (typed, submitted); the streamed answer once done."""
    browser.find_element("id", "max-tokens").clear()
    browser.find_element("id", "max-tokens").send_keys(str(max_tokens))
    box = browser.find_element("id", "chat-input")
    box.send_keys(prompt)
    box.submit()
    _wait(browser, "const a = document.getElementById('last-answer'); return a && a.dataset.state === 'done'",
          "the streamed answer", 120)
    return _js(browser, "return document.getElementById('last-answer').textContent")


#: the chat box's answer length: enough to prove the streamed chunks add up to the API's answer (TP=3 on 2
#: shared cores: a ring token costs ~1.5 s of CPU here, its three ranks busy-polling)
CHAT_TOKENS = 4


class _Running:
    """A streamed request in flight until :meth:`close`, which disconnects (the server cancels the
    generation): tok/s is observed while it runs, without waiting for it to end.  A plain socket that
    sends the request and reads nothing (the events wait in its buffer), so that :meth:`close` disconnects
    at once, not when a reader sees its next event."""

    def __init__(self, url, body):
        parts = urllib.parse.urlsplit(url)
        data = json.dumps(dict(body, stream=True)).encode()
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        self.sock.sendall(f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)

    def close(self):
        self.sock.close()


def _stop_serve(serve):
    """SIGTERM ``serve`` and SIGKILL the ranks below it until it exits: after the killed rank its healer is
    starting a new group, which serve would wait for (three ranks loading, 7-20 s here) only to stop it."""
    serve.proc.send_signal(signal.SIGTERM)

    def gone():
        for pid in descendants(serve.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return serve.proc.poll() is not None

    until(gone, 60, "serve to exit", interval_s=0.1)


#: JS: whether chart ``%s``'s first path has a point above its baseline (y < 77 in its 300 x 80 box)
_CHART_ABOVE_ZERO = ("const p = document.querySelector('#%s path.series'); "
                     "return !!p && (p.getAttribute('d').match(/[ML][0-9.]+,[0-9.]+/g) || [])"
                     ".some(c => parseFloat(c.split(',')[1]) < 77)")


def _charts_have_points(browser, ranks):
    """The page's charts (inline SVG, the last 5 minutes of snapshots) drew a line of >= 2 points
    after two snapshots: tok/s, queue (queued, in flight) and one line per rank's memory."""
    _wait(browser, "return Array.from(document.querySelectorAll('#chart-memory path.series'))"
                   ".filter(p => +p.dataset.points >= 2).length === %d" % ranks, "a memory line per rank", 30)
    counts = _js(browser, "const out = {}; for (const id of ['chart-tok-s', 'chart-queue', 'chart-memory']) "
                          "out[id] = Array.from(document.querySelectorAll('#' + id + ' path.series')).map(p => "
                          "[p.dataset.series, +p.dataset.points, (p.getAttribute('d').match(/[ML]/g) || []).length]);"
                          " return out")
    assert [c[0] for c in counts["chart-queue"]] == ["queued", "in flight"], counts
    assert sorted(c[0] for c in counts["chart-memory"]) == [f"rank {r}" for r in range(ranks)], counts
    for series in counts.values():
        assert all(points >= 2 and commands == points for _, points, commands in series), counts
    # memory in use is above zero on every rank's line
    assert _js(browser, "return Array.from(document.querySelectorAll('#chart-memory path.series')).every(p => "
                        "p.getAttribute('d').match(/[ML][0-9.]+,[0-9.]+/g).some(c => parseFloat(c.split(',')[1]) < 77))")


def _screenshots(browser, name):
    """Desktop (1280x800) and phone (390x844) screenshots; the phone width scrolls no sideways."""
    browser.execute_script("document.activeElement.blur(); window.scrollTo(0, 0)")
    browser.save_screenshot(os.path.join(ARTIFACTS, f"{name}-desktop.png"))
    browser.set_window_size(390, 844)
    assert _js(browser, "return document.documentElement.scrollWidth <= window.innerWidth + 1")
    browser.save_screenshot(os.path.join(ARTIFACTS, f"{name}-phone.png"))
    browser.set_window_size(1280, 800)


@pytest.mark.slow
def test_dashboard_in_chromium(browser, real_model_path):
    os.makedirs(ARTIFACTS, exist_ok=True)
    serve = Serve(world_size=3)
    try:
        until(lambda: (serve.health() or (0,))[0] == 200, 240, "serve healthy")
        browser.get(serve.url + "/")
        live = _wait(browser, "return document.querySelectorAll('#ranks tbody tr.alive').length === 3 && "
                              "Array.from(document.querySelectorAll('#ranks td.memory')).map(td => td.textContent)",
                     "3 live ranks with their memory")
        assert all(float(m.split()[0]) > 0 for m in live)
        assert _js(browser, "return document.querySelectorAll('#graph .node.alive').length") == 3
        _charts_have_points(browser, ranks=3)
        # the chat box streams the same answer as the API (greedy)
        prompt = "Name a planet."
        expected = httpx.post(serve.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "temperature": 0, "max_tokens": CHAT_TOKENS,
            "messages": [{"role": "user", "content": prompt}]}).json()["choices"][0]["message"]["content"]
        assert _chat(browser, prompt, CHAT_TOKENS) == expected
        # tok/s moves while a request runs (streamed, disconnected once seen)
        running = _Running(serve.url + "/v1/completions",
                           {"model": "m", "prompt": "The capital of France is", "max_tokens": 400, "temperature": 0})
        try:
            _wait(browser, "return parseFloat(document.getElementById('tok-s').textContent) > 0", "tok/s > 0", 120)
            _wait(browser, _CHART_ABOVE_ZERO % "chart-tok-s", "the tok/s chart above zero", 10)
            _screenshots(browser, "dashboard")
        finally:
            running.close()
        assert _wait(browser, _CHART_ABOVE_ZERO % "chart-ttft", "a TTFT on its chart", 10)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        # a SIGKILLed rank turns the page red within the heartbeat timeout (5 s) plus a refresh
        pids = rank_pids(serve.proc.pid)
        t0 = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        _wait(browser, "return document.querySelectorAll('#ranks tbody tr.lost').length >= 1", "a lost rank", 15)
        assert time.monotonic() - t0 < 15
        browser.save_screenshot(os.path.join(ARTIFACTS, "dashboard-rank-lost.png"))
    finally:
        _stop_serve(serve)


@pytest.mark.slow
def test_join_node_dashboard_in_chromium(browser, tmp_path):
    """Every ``join`` node serves the page for its cluster: three nodes on loopback form TP=3; node 0's
    page shows the three nodes live with their ranks and rank memory, its chat box streams the answer
    ``generate --cluster --chat`` prints, tok/s moves while a request runs, and a SIGKILLed node turns
    red within the peer timeout (3 s) plus a refresh."""
    import json
    import subprocess
    import sys
    import uuid

    from mlxcluster.runtime.launcher import free_ports
    from test_cluster import SECRET, JoinNode, _env, wait_formed

    os.makedirs(ARTIFACTS, exist_ok=True)
    cluster = f"board-{uuid.uuid4().hex[:8]}"
    ports = free_ports(6)
    nodes = [JoinNode(tmp_path, cluster, f"n{i}", "127.0.0.1", ports[i], extra=("--dashboard-port", str(ports[3 + i])))
             for i in range(3)]
    try:
        wait_formed(cluster, ["127.0.0.1"])
        url = f"http://127.0.0.1:{ports[3]}"
        other = httpx.get(f"http://127.0.0.1:{ports[4]}/dashboard/state", timeout=30).json()  # every node serves it
        assert other["node_id"] == "n1" and sorted(n["node_id"] for n in other["nodes"]) == ["n0", "n1", "n2"]
        browser.get(url + "/")
        _wait(browser, "return document.querySelectorAll('#nodes tbody tr.alive').length === 3", "3 live nodes")
        live = _wait(browser, "return document.querySelectorAll('#ranks tbody tr.alive').length === 3 && "
                              "Array.from(document.querySelectorAll('#ranks td.memory')).map(td => td.textContent)",
                     "3 live ranks with their memory")
        assert all(float(m.split()[0]) > 0 for m in live)
        assert sorted(_js(browser, "return Array.from(document.querySelectorAll('#graph .node.alive'))"
                                   ".map(g => g.dataset.rank)")) == ["0", "1", "2"]
        _charts_have_points(browser, ranks=3)
        # the chat box streams what `generate --cluster --chat` prints (greedy)
        prompt = "Name a planet."
        out = subprocess.run([sys.executable, "-m", "mlxcluster", "generate", prompt, "--chat", "--cluster", cluster,
                              "--interface", "127.0.0.1", "--max-tokens", str(CHAT_TOKENS), "--json"],
                             capture_output=True, text=True, env=_env({"MLXCLUSTER_SECRET": SECRET}), timeout=300)
        assert out.returncode == 0, out.stderr
        expected = json.loads(out.stdout)["text"]
        assert _chat(browser, prompt, CHAT_TOKENS) == expected
        # tok/s moves while a request runs (rank 0's counters: any client counts; streamed, disconnected once seen)
        running = _Running(url + "/v1/chat/completions", {
            "max_tokens": 400, "temperature": 0, "messages": [{"role": "user", "content": "Tell a story."}]})
        try:
            _wait(browser, "return parseFloat(document.getElementById('tok-s').textContent) > 0", "tok/s > 0", 120)
            _screenshots(browser, "node-dashboard")
        finally:
            running.close()
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        t0 = time.monotonic()
        nodes[2].kill()
        _wait(browser, "const r = document.querySelector('#nodes tbody tr[data-node=\"n2\"]'); "
                       "return r && r.classList.contains('lost')", "node n2 drawn lost", 15)
        assert time.monotonic() - t0 < 3.0 + 1.0 + 5.0  # PEER_TIMEOUT_S, a snapshot, a heartbeat's slack
        assert _js(browser, "return document.querySelector('#graph .node.lost') !== null")
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(os.path.join(ARTIFACTS, "node-dashboard-node-lost.png"))
    finally:
        for n in nodes:
            n.stop()


def _snapshot(**kw):
    s = {"model": "m", "world_size": 1, "backend": "ring", "weight_format": "float32", "ranks": [],
         "decode_tokens_per_s": 12.5, "ttft_s": 0.2, "tokens_total": 90, "group": {"status": "ok"}, "errors": [],
         "queue": {"queued": 0, "running": 2, "capacity": 8}, "time": 1000.0}
    s.update(kw)
    return s


def test_the_page_shows_speculative_decoding_beside_tok_s():
    """dashboard.js renders a snapshot's ``speculative`` figures (rank 0's acceptance rate and tokens per
    step, the server's drafter and bound) next to decode tok/s: "–" before any draft, "off" without a
    default drafter (node runs the page's script against stand-in elements; the real page in Chromium:
    the slow tests above)."""
    import json
    import subprocess

    if not NODE:
        pytest.skip("node is not installed")
    from mlxcluster.front.provider import speculative_figures
    from mlxcluster.protocol import mlxcluster_pb2 as pb

    page = os.path.join(os.path.dirname(os.path.dirname(__file__)), "mlxcluster", "front", "dashboard")
    html = open(os.path.join(page, "index.html")).read()
    assert all(f'id="{i}"' in html for i in ("spec-draft", "spec-acceptance", "spec-tokens-per-step"))
    info = pb.InfoReply(draft="ngram", draft_tokens=4, spec_drafted_tokens=40, spec_accepted_tokens=30,
                        spec_steps=10, spec_emitted_tokens=40)
    shown = [_snapshot(speculative=speculative_figures(pb.InfoReply(draft="ngram", draft_tokens=4))),
             _snapshot(speculative=speculative_figures(info)),
             _snapshot(speculative=speculative_figures(pb.InfoReply())), _snapshot()]
    out = subprocess.run([NODE, "-e", _FAKE_PAGE, os.path.join(page, "dashboard.js")], capture_output=True,
                         text=True, timeout=30, input="\n".join(json.dumps(s) for s in shown))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert [g["tok-s"] for g in got] == ["12.5"] * 4
    assert [(g["spec-draft"], g["spec-acceptance"], g["spec-tokens-per-step"]) for g in got] == [
        ("ngram · k ≤ 4", "–", "–"), ("ngram · k ≤ 4", "75 %", "4.00"), ("off", "–", "–"), ("–", "–", "–")]


def test_a_node_page_shows_the_plans_prediction_beside_its_measurement():
    """A join node's snapshot (``plan``: :func:`~mlxcluster.cluster.measure.plan_view` of rank 0's node)
    shows the chosen plan's predicted decode tok/s and TTFT beside the measured ones ("measuring…"
    before any request); a snapshot without a plan hides the line."""
    import json
    import subprocess

    if not NODE:
        pytest.skip("node is not installed")
    from mlxcluster.cluster.measure import plan_view
    from mlxcluster.protocol import mlxcluster_pb2 as pb

    page = os.path.join(os.path.dirname(os.path.dirname(__file__)), "mlxcluster", "front", "dashboard")
    assert 'id="plan"' in open(os.path.join(page, "index.html")).read()
    node = {"node_id": "a", "cluster": "c", "state": "running", "waiting": "", "fetch": None,
            "nodes": [{"node_id": "a", "status": "live", "state": "running", "rank": 0, "address": "x", "self": True}]}
    plan = pb.PlanMsg(label="TP=3 on a,b,c", mode="auto", decode_tok_s=11.7, ttft_s=0.21, prompt_tokens=512)
    measured = pb.PlanMsg(); measured.CopyFrom(plan)  # noqa: E702
    measured.measured_decode_tok_s, measured.measured_ttft_s = 10.94, 0.25
    shown = [_snapshot(**node, plan=plan_view(plan)), _snapshot(**node, plan=plan_view(measured)),
             _snapshot(**node, plan=None)]
    out = subprocess.run([NODE, "-e", _FAKE_PAGE, os.path.join(page, "dashboard.js")], capture_output=True,
                         text=True, timeout=30, input="\n".join(json.dumps(s) for s in shown))
    assert out.returncode == 0, out.stderr
    got = [g["plan"] for g in json.loads(out.stdout)]
    assert got[0] == "plan TP=3 on a,b,c (auto): predicted 11.7 tok/s, TTFT 0.21 s (512 tokens); measuring…"
    assert got[1] == "plan TP=3 on a,b,c (auto): predicted 11.7 tok/s, TTFT 0.21 s (512 tokens); " \
                     "measured 10.9 tok/s, TTFT 0.25 s"
