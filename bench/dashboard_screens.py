"""The screenshots of docs/server.md ("Dashboard"): headless Chromium at 1280 x 800 on `moelane serve` (the shipped
model, half its experts' bytes paged, unless other serve options follow --) under 4 streaming clients, and on the
page `moelane trace analyze --html` writes for the shipped trace fixture. Needs Debian's chromium and
chromium-driver, and selenium (the dev extra). Prints one JSON line naming what it wrote.

    python bench/dashboard_screens.py --out docs/img [--seconds 40] [-- --expert-memory 25%]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from dashboard_ab import Server

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "fixtures" / "traces" / "default.trc"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")  # fmt: skip
PROMPTS = ["def fibonacci(n):\n    ", "ROMEO. But soft, what light through yonder window breaks?\n",
           "import os\nimport sys\n\n\ndef main(argv):\n", "*options.txt*  For Vim version 9.0.\n\n"]  # fmt: skip


def browser(profile: str) -> Any:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def viewport(driver: Any, width: int, height: int) -> None:
    """The page's own area `width` x `height` (the window is that plus the browser's frame)."""
    driver.set_window_size(width, height)
    frame = driver.execute_script("return [outerWidth - innerWidth, outerHeight - innerHeight]")
    driver.set_window_size(width + frame[0], height + frame[1])
    time.sleep(1.5)  # (the page draws again on resize; a poll may come in between)


def shoot(driver: Any, out: Path, name: str) -> list[str]:
    """`name`.png, the page at 1280 x 800, and `name`-full.png, the whole page 1280 wide."""
    viewport(driver, 1280, 800)
    driver.save_screenshot(str(out / f"{name}.png"))
    viewport(driver, 1280, driver.execute_script("return document.documentElement.scrollHeight"))
    driver.save_screenshot(str(out / f"{name}-full.png"))
    return [f"{name}.png", f"{name}-full.png"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/img", help="folder of the screenshots (default docs/img)")
    p.add_argument("--seconds", type=float, default=40.0, help="load before the live screenshot (default 40)")
    p.add_argument("serve_args", nargs="*", help="after --: `moelane serve` options (default --expert-memory 50%%)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "trace.html"
        subprocess.run([sys.executable, "-m", "moelane", "trace", "analyze", str(TRACE), "--html", str(report)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        server = Server(args.serve_args or ["--expert-memory", "50%"], None, 300)
        stop = threading.Event()

        def client(i: int) -> None:
            with httpx.Client(timeout=120) as c:
                while not stop.is_set():
                    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 96, "temperature": 0.7, "seed": i,
                            "stream": True}  # fmt: skip
                    with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        driver = browser(str(Path(tmp) / "profile"))
        try:
            for t in threads:
                t.start()
            driver.get(f"{server.url}/dashboard")
            time.sleep(args.seconds)
            written += shoot(driver, out, "dashboard")
            driver.get(report.as_uri())
            written += shoot(driver, out, "trace-report")
        finally:
            driver.quit()
            stop.set()
            server.stop()
    print(json.dumps({"wrote": [str(out / name) for name in written], "serve_args": args.serve_args}), flush=True)


if __name__ == "__main__":
    main()
