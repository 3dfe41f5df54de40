"""The dashboard in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, driven by selenium)
opens `/dashboard?key=...` of a running `moelane serve` (a tiny model with half its experts paged, an API key) while
4 streaming clients run, and the test checks what a person would see: every chart drawn, the hit rate and tok/s
figures moving between two reads, a heat map of layers x experts cells, and no error in the page's console.
Skipped, saying why, where the browser, its driver or selenium is missing (.ci/run installs them)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import random_model

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
KEY = "sk-browser-test"
# Headless, and nothing that reaches for a network this machine does not have (else the log fills with its errors).
QUIET_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage")  # fmt: skip
CHARTS = ("card-hit", "card-stall", "card-reads", "card-levels", "card-bandit", "card-toks", "card-streams",
          "card-rounds", "card-rows")  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                       reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`moelane serve` in a subprocess on a free port; yields its base URL."""
    folder: Path = random_model("qwen3_moe", tmp_path_factory.mktemp("browser-q3"), num_experts=16, mlp_only_layers=[])
    cmd = [sys.executable, "-m", "moelane", "serve", "--model", str(folder), "--port", "0", "--expert-memory", "50%",
           "--api-key", KEY, "--log-level", "warning", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        said = []
        for line in proc.stderr:
            said.append(line)
            if found := re.search(r"serving \S+ on (http://\S+)/v1", line):
                break
        else:
            pytest.fail("moelane serve did not start:\n" + "".join(said[-20:]))
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # (drained, so the server never blocks)
        yield found[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def clients(server: str) -> Iterator[None]:
    """4 clients streaming completions one after another until the test ends."""
    stop = threading.Event()

    def run(i: int) -> None:
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            while not stop.is_set():
                body = {"prompt": f"client {i} says", "max_tokens": 40, "temperature": 0.8, "seed": i, "stream": True}
                with c.stream("POST", f"{server}/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join(timeout=60)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the dev extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*QUIET_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,800"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


def wait_for(check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def figures(driver: Any) -> tuple[str, str]:
    return (driver.find_element("id", "hit-now").text, driver.find_element("id", "toks-now").text)


def test_the_dashboard_draws_the_server_under_load(server: str, clients: None, browser: Any) -> None:
    browser.get(f"{server}/dashboard?key={KEY}")  # (answered with a cookie and a redirect to /dashboard)
    assert wait_for(lambda: browser.find_element("id", "status").text == "live"), browser.find_element("id", "status")
    assert browser.current_url == f"{server}/dashboard"
    script = "return document.querySelectorAll('#%s svg path.line, #%s svg rect.bar').length"
    assert wait_for(lambda: all(browser.execute_script(script % (c, c)) for c in CHARTS)), [
        (c, browser.execute_script(script % (c, c))) for c in CHARTS
    ]
    paths = browser.execute_script("return [...document.querySelectorAll('path.line')].map(p => p.getAttribute('d'))")
    assert paths and all(re.match(r"M[\d.]+ [\d.]+", d) for d in paths), paths
    before = figures(browser)
    moved = wait_for(lambda: all(a != b for a, b in zip(before, figures(browser), strict=True)), 20)
    assert moved, (before, figures(browser))
    stats = httpx.get(f"{server}/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    heat = stats["pager"]["heatmap"]
    cells = browser.execute_script("return document.querySelectorAll('#card-heat svg rect.cell').length")
    assert cells == len(heat["layers"]) * heat["n_experts"] == 3 * 16
    assert browser.find_elements("css selector", "#request-table tr")[1:], "no request in the log"
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
