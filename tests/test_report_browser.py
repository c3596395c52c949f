"""report.html in a real headless Chromium (Debian's `chromium`, see scripts/install_chromium.sh):
it loads with no console error, the heatmap and the curves are drawn, and hostile config strings
stay text. Driven through the DevTools protocol (a websocket), which also takes a screenshot.

    REPORT_SCREENSHOT=/tmp/report_screenshot.png pytest tests/test_report_browser.py   # keep the picture
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from sweep.report.__main__ import main as report_main

from .test_report_tables import make_grid, write_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# In CI a missing browser is a failure (scripts/install_chromium.sh installs it); elsewhere a skip.
_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not _IN_CI, reason="no chromium: run scripts/install_chromium.sh"
)

XSS_IMG = '<img src=x onerror="window.__pwned=1">'
XSS_SCRIPT = "</script><script>window.__pwned=2</script>"


class DevTools:
    """The smallest DevTools-protocol client: call a method, collect the events that arrive meanwhile."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.events: list[dict] = []
        self._id = 0

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, event: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for msg in self.events:
                if msg.get("method") == event:
                    return msg
            self.events.append(json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic()))))

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads seen so far."""
        out = []
        for msg in self.events:
            method, params = msg.get("method"), msg.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                out.append(params["entry"].get("text", ""))
        return out


@pytest.fixture
def browser(tmp_path):
    assert Path(CHROMIUM).exists(), "no chromium in CI: scripts/install_chromium.sh installs it"
    profile = tmp_path / "profile"
    # its singleton socket's folder goes in TMPDIR and stays there when it is stopped: a short one of ours (a socket's
    # path is at most 107 bytes: under tmp_path, chromium aborts)
    temp = tempfile.mkdtemp(prefix="chromium-")
    proc = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1280,2200",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": temp},
    )
    try:
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        from websockets.sync.client import connect

        with connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=20) as ws:
            yield DevTools(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_report_in_headless_chromium(browser, tmp_path, capsys):
    root = make_grid(tmp_path / "sweep")
    write_run(
        root,
        100,
        {"precision": "fp32", "optim.lr": 1e-4, "attention": XSS_IMG, "steps": 8},
        {"status": "stable", "final_loss": 0.9},
    )
    write_run(
        root,
        101,
        {"precision": XSS_SCRIPT, "optim.lr": 1e-3, "attention": "flash", "steps": 8},
        {"status": "diverged", "verdict": "loss_spike", "first_bad_step": 2, "cause": {"where": "loss"}},
    )
    assert report_main([str(root)]) == 0
    capsys.readouterr()

    for domain in ("Runtime", "Log", "Page"):
        browser.call(f"{domain}.enable")
    browser.call("Page.navigate", url=(root / "report.html").as_uri())
    browser.wait_for("Page.loadEventFired", timeout=60)
    drawn = "document.querySelectorAll('#divergence-heatmap g.hm image').length"
    deadline = time.monotonic() + 20
    while not browser.evaluate(drawn):
        assert time.monotonic() < deadline, "the heatmap was never drawn"
        time.sleep(0.2)

    assert browser.errors() == []
    assert browser.evaluate("document.getElementById('divergence-heatmap').data[0].type") == "heatmap"
    cell_texts = browser.evaluate("[...document.querySelectorAll('#divergence-heatmap text')].map(t => t.textContent)")
    assert {"stable", "spike@7", "nan-grad@3", "nan-loss@1"} <= set(cell_texts)
    assert any(XSS_IMG in t for t in cell_texts)  # in a column label, shown as text
    n_curves = browser.evaluate("document.querySelectorAll('div[id^=curves-] .main-svg').length")
    assert n_curves >= 8  # one figure per combination, drawn
    assert browser.evaluate("document.querySelectorAll('div[id^=curves-] path.point').length") > 0  # x marks
    assert browser.evaluate("window.__pwned === undefined")
    assert browser.evaluate("document.querySelectorAll('img').length") == 0
    body = browser.evaluate("document.body.innerText")
    assert XSS_IMG in body and XSS_SCRIPT in body and "Recommendation" in body

    shot = tmp_path / "report.png"
    shot.write_bytes(__import__("base64").b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    assert shot.stat().st_size > 20_000
    if os.environ.get("REPORT_SCREENSHOT"):
        shutil.copy(shot, os.environ["REPORT_SCREENSHOT"])

    # plotly.js is loaded from the file beside the page: the line that says what to do without it stays hidden
    assert list(root.glob("plotly-*.min.js")) and browser.evaluate("document.getElementById('plotly-missing').hidden")
    moved = tmp_path / "moved" / "report.html"
    moved.parent.mkdir()
    shutil.copy(root / "report.html", moved)
    browser.events.clear()  # the first page's load event
    browser.call("Page.navigate", url=moved.as_uri())
    browser.wait_for("Page.loadEventFired", timeout=60)  # fired with its script missing too
    assert browser.evaluate("document.URL") == moved.as_uri()
    line = "document.getElementById('plotly-missing')"
    assert browser.evaluate(f"!{line}.hidden && {line}.offsetHeight > 0")
    assert "--self-contained" in browser.evaluate(f"{line}.innerText")
