"""Property-based API test of `moelane serve` with schemathesis, over the server's own OpenAPI schema.

schemathesis is not a dependency of moelane: install it anywhere (e.g. its own venv, `pip install
schemathesis==4.32.5`) and pass its executable. The script serves a tiny random qwen3_moe (context 64, so every
generated request is quick; built with tests/helpers.py) unless `--model` is given, runs `schemathesis run` against
`/openapi.json` with every check except the ones that do not apply (auth checks; `positive_data_acceptance`, since a
schema-valid prompt can still be longer than the context and then rightly gets a 400), and prints its report and a
JSON summary line. Exit status: schemathesis's.

    python bench/schemathesis_run.py --schemathesis /path/venv/bin/schemathesis
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
EXCLUDED = "positive_data_acceptance,ignored_auth,object_level_authorization,missing_required_header"


def tiny_model(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import random_model

    return random_model("qwen3_moe", folder, max_position_embeddings=64, mlp_only_layers=[])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not come up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemathesis", required=True, help="the schemathesis executable")
    p.add_argument("--model", help="model folder (default: a tiny random qwen3_moe)")
    p.add_argument("--port", type=int, default=8411)
    p.add_argument("--max-examples", type=int, default=60)
    p.add_argument("--workers", default="2")
    p.add_argument("--max-time", type=int, default=900, help="seconds for the whole schemathesis run")
    p.add_argument("--request-timeout", type=int, default=120, help="seconds one request may take (slow machines)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_model(Path(tmp) / "model")
        url = f"http://127.0.0.1:{args.port}"
        cmd = [sys.executable, "-m", "moelane", "serve", "--model", str(model), "--port", str(args.port),
               "--served-model-name", "tiny", "--max-queue", "256", "--drafter", "recall",
               "--log-level", "info"]  # fmt: skip
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115 (closed below)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(url, server)
            st = [args.schemathesis, "run", f"{url}/openapi.json", "--checks", "all", "--exclude-checks", EXCLUDED,
                  "--max-examples", str(args.max_examples), "--workers", args.workers, "--max-time",
                  str(args.max_time), "--suppress-health-check", "too_slow", "--no-color",
                  "--request-timeout", str(args.request_timeout),
                  "--max-response-time", str(args.request_timeout)]  # fmt: skip
            run = subprocess.run(st, capture_output=True, text=True)
            report = run.stdout + run.stderr
            print(report[-12000:])
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
            server_log = (Path(tmp) / "server.log").read_text(errors="replace")
    n_5xx = len(re.findall(r'" 5\d\d ', server_log))
    print(json.dumps({"bench": "schemathesis", "exit": run.returncode, "server_5xx_logged": n_5xx,
                      "model": args.model or "tiny random qwen3_moe (context 64)"}))  # fmt: skip
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
