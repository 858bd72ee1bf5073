"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium) against a real ``serve --world-size 3``.

The page loads with no console errors, shows 3 live ranks with their memory, the chat box streams
the same answer as the API, the tok/s figure moves while a request runs, and a SIGKILLed rank turns
the page red within the heartbeat timeout.  Screenshots (desktop 1280x800 and phone 390x844) are
saved under ``$MLXCLUSTER_ARTIFACTS`` (default ``artifacts/``).
"""

import os
import shutil
import signal
import threading
import time

import httpx
import pytest

from test_healing import Serve, rank_pids, until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
ARTIFACTS = os.environ.get("MLXCLUSTER_ARTIFACTS", os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                                                 "artifacts"))

pytestmark = pytest.mark.slow


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
        # the chat box streams the same answer as the API (greedy)
        prompt = "Name a planet."
        expected = httpx.post(serve.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": prompt}]}).json()["choices"][0]["message"]["content"]
        browser.find_element("id", "max-tokens").clear()
        browser.find_element("id", "max-tokens").send_keys("24")
        box = browser.find_element("id", "chat-input")
        box.send_keys(prompt)
        box.submit()
        _wait(browser, "const a = document.getElementById('last-answer'); return a && a.dataset.state === 'done'",
              "the streamed answer", 120)
        assert _js(browser, "return document.getElementById('last-answer').textContent") == expected
        # tok/s moves while a request runs
        done = threading.Event()
        threading.Thread(target=lambda: (serve.complete(max_tokens=120), done.set()), daemon=True).start()
        _wait(browser, "return parseFloat(document.getElementById('tok-s').textContent) > 0", "tok/s > 0", 120)
        browser.save_screenshot(os.path.join(ARTIFACTS, "dashboard-desktop.png"))
        browser.set_window_size(390, 844)
        assert _js(browser, "return document.documentElement.scrollWidth <= window.innerWidth + 1")  # no sideways scroll
        browser.save_screenshot(os.path.join(ARTIFACTS, "dashboard-phone.png"))
        browser.set_window_size(1280, 800)
        done.wait(180)
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
        serve.stop()
