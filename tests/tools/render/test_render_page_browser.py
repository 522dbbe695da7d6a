"""The dumped HTML page in a real browser: headless Chromium driven over the DevTools protocol on a
pipe (``--remote-debugging-pipe``: JSON messages ending in a NUL byte on file descriptors 3 and 4).

It loads without console errors, opens with the boxes closed at a scale where labels read, a click
on a layer block opens it and shows its nodes, a click on its header closes it again, a search
opens the boxes around its hit, and with every box open every node is drawn inside the frames of
the boxes around it and no two overlap.  Skipped
where Chromium is not installed (CI).  ``HGRAPH_PAGE_SCREENSHOT=FILE.png`` saves the first view.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time

import pytest

from hgraph.tools.cli import main

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER = next((path for path in map(shutil.which, BROWSERS) if path), None)
WIDTH, HEIGHT = 1400, 900
TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(BROWSER is None, reason="Chromium is not installed")


class DevTools:
    """One headless Chromium and a page in it, spoken to over the DevTools pipe."""

    def __init__(self, browser: str):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire():  # the browser reads commands from fd 3 and writes replies to fd 4
            # Moved out of the way first: the pipe may already sit on fd 3 or 4, and dup2 onto the
            # same number would keep its close-on-exec flag.
            reads, writes = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(reads, 3)
            os.dup2(writes, 4)

        self.proc = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--no-first-run", f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=wire, close_fds=False)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Page", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(left, 0))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, *, session: bool = False) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            event = self._receive(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def click(self, x: float, y: float) -> None:
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent",
                      {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}, session=True)

    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries seen so far."""
        out = []
        for event in self.events:
            params = event.get("params", {})
            if event.get("method") == "Runtime.exceptionThrown":
                out.append(params["exceptionDetails"].get("text", "exception"))
            elif event.get("method") == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif event.get("method") == "Log.entryAdded" and params["entry"].get("level") == "error":
                out.append(params["entry"].get("text", "error"))
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=TIMEOUT_S)
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture(scope="module")
def dumped_page(tmp_path_factory):
    path = tmp_path_factory.mktemp("page") / "dump.html"
    code = main(["dump", "llama:tiny", "--strategy", "1xTP2PP2+1xTP1PP1", "--format", "html",
                 "--model-args", '{"num_layers": 4}', "-o", str(path)])
    assert code == 0
    return path


# Boxes on screen: id, kind and the centre of the face the user clicks.
_BOXES = """Array.from(document.querySelectorAll('#graph g.box')).map(function (g) {
  var r = g.querySelector('rect.face').getBoundingClientRect();
  return {id: g.getAttribute('data-box'), kind: g.getAttribute('data-kind'), x: r.left + r.width / 2,
          y: r.top + r.height / 2, w: r.width, h: r.height};
})"""
# Nodes drawn inside box ID (at any depth) according to the page's own data.
_NODES_IN = """(function (id) {
  var D = JSON.parse(document.getElementById('graph-data').textContent);
  return Array.from(document.querySelectorAll('#graph g.node')).filter(function (g) {
    for (var b = D.nodes[g.getAttribute('data-id')].b; b; b = D.boxes[b].parent) if (b === id) return true;
    return false;
  }).length;
})(%s)"""

# Pairs of drawn nodes whose boxes overlap, and nodes outside the frame of an open box around them
# (in the drawing's own units).
_OVERLAPS = """(function () {
  var D = JSON.parse(document.getElementById('graph-data').textContent);
  function box(rect) {
    var x = +rect.getAttribute('x'), y = +rect.getAttribute('y');
    return [x, y, x + +rect.getAttribute('width'), y + +rect.getAttribute('height')];
  }
  var frames = {};
  document.querySelectorAll('#graph g.frame').forEach(function (g) { frames[g.getAttribute('data-box')] = box(g.querySelector('rect')); });
  var n = 0, r = Array.from(document.querySelectorAll('#graph g.node')).map(function (g) {
    var b = box(g.querySelector('rect.face'));
    for (var p = D.nodes[g.getAttribute('data-id')].b; p; p = D.boxes[p].parent) {
      var f = frames[p];
      if (b[0] < f[0] || b[1] < f[1] || b[2] > f[2] || b[3] > f[3]) n++;
    }
    return b;
  }).sort(function (a, b) { return a[0] - b[0]; });
  for (var i = 0; i < r.length; i++)
    for (var j = i + 1; j < r.length && r[j][0] < r[i][2] - 0.5; j++)
      if (r[j][1] < r[i][3] - 0.5 && r[i][1] < r[j][3] - 0.5) n++;
  return n;
})()"""


def test_page_opens_closed_and_a_click_opens_and_closes_a_block(dumped_page):
    tools = DevTools(BROWSER)
    try:
        tools.call("Page.navigate", {"url": dumped_page.as_uri()}, session=True)
        tools.wait_for("Page.loadEventFired")
        assert tools.errors() == []
        total = len(json.loads(tools.evaluate("document.getElementById('graph-data').textContent"))["nodes"])
        boxes = tools.evaluate(_BOXES)
        nodes_shown = tools.evaluate("document.querySelectorAll('#graph g.node').length")
        assert boxes and nodes_shown < total / 5, (len(boxes), nodes_shown, total)
        assert tools.evaluate("document.querySelectorAll('#graph g.frame').length") == 0
        assert tools.evaluate("hgraphPage.state().scale") >= 0.6  # 11px labels at 6.6px or more
        in_view = [b for b in boxes if 0 < b["x"] < WIDTH and 0 < b["y"] < HEIGHT]
        assert len(in_view) >= len(boxes) / 2, "the first view shows most boxes"
        assert tools.evaluate("document.querySelectorAll('#graph path.edge.comm').length") > 0
        if os.environ.get("HGRAPH_PAGE_SCREENSHOT"):
            shot = tools.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
            with open(os.environ["HGRAPH_PAGE_SCREENSHOT"], "wb") as f:
                f.write(base64.b64decode(shot))

        block = next(b for b in in_view if b["kind"] == "block" and b["y"] > 120)
        tools.click(block["x"], block["y"])
        assert tools.evaluate(f"document.querySelectorAll('#graph g.frame[data-box=\"{block['id']}\"]').length") == 1
        inside = tools.evaluate(_NODES_IN % json.dumps(block["id"]))
        assert inside > 0, "the opened block shows its nodes"
        slot_boxes = [b for b in tools.evaluate(_BOXES) if b["kind"] in ("pull_parameter", "push_gradient")]
        assert slot_boxes, "slot subgraphs inside the block are boxes of their own"
        assert tools.evaluate("document.querySelectorAll('#graph path.edge.comm').length") > 0

        head = tools.evaluate(f"""(function () {{
          var r = document.querySelector('#graph g.frame-head[data-box="{block['id']}"] rect').getBoundingClientRect();
          return [r.left + 20, r.top + r.height / 2]; }})()""")
        tools.click(*head)
        assert tools.evaluate("document.querySelectorAll('#graph g.frame').length") == 0
        assert tools.evaluate(_NODES_IN % json.dumps(block["id"])) == 0

        # Search: Enter opens the boxes around the next hit, which is then drawn as a node.
        hit = tools.evaluate("""(function () {
          var s = document.getElementById('search');
          s.value = 'q_proj'; s.dispatchEvent(new Event('input'));
          s.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'}));
          var g = document.querySelector('#graph g.node.hit');
          return [document.getElementById('found').textContent, g && g.getAttribute('data-id')];
        })()""")
        assert hit[0].endswith(" found") and int(hit[0].split()[0]) > 0 and hit[1], hit

        tools.evaluate("hgraphPage.expandAll()")  # the page's own layout of every box open
        assert tools.evaluate("document.querySelectorAll('#graph g.node').length") == total
        assert tools.evaluate(_OVERLAPS) == 0
        assert tools.errors() == []
    finally:
        tools.close()
