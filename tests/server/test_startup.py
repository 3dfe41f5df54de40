"""What `moelane serve` checks and says at start-up: the address it listens on (the port the system chose, with
`--port 0`), on stderr as its other progress lines; and a chat template that cannot be compiled, which refuses the
start in one line, while one that refuses some messages when rendered answers those requests with a 400."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn

from moelane.commands import build_parser, main, serve
from moelane.errors import ModelLoadError
from moelane.model.tokenizer import Tokenizer
from moelane.server.app import create_app
from tests.helpers import write_tokenizer
from tests.server.conftest import MODEL, make_engine, running, wait_until
from tests.server.fake_engine import FakeEngine


def lm_with_template(folder: Path, template: str) -> Any:
    """A model stand-in whose tokenizer has `template` as its chat template."""
    write_tokenizer(folder, 300)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tokenizer = Tokenizer(folder, frozenset())
    return SimpleNamespace(tokenizer=tokenizer, max_context=4096, vocab_size=tokenizer.vocab_size, close=lambda: None)


def test_serve_on_port_0_says_the_port_it_listens_on(
    tiny_lm: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lm = SimpleNamespace(tokenizer=tiny_lm.tokenizer, max_context=tiny_lm.max_context, vocab_size=tiny_lm.vocab_size,
                         close=lambda: None)  # fmt: skip
    monkeypatch.setattr(serve, "build", lambda args: create_app(make_engine(tiny_lm), lm, model_name=MODEL))
    servers: list[uvicorn.Server] = []

    class Server(uvicorn.Server):  # (kept, to be stopped)
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            servers.append(self)

    monkeypatch.setattr(uvicorn, "Server", Server)
    args = build_parser().parse_args(["serve", "--port", "0", "--log-level", "warning"])
    exits: list[int] = []
    thread = threading.Thread(target=lambda: exits.append(serve.cmd_serve(args)), daemon=True)
    thread.start()
    try:
        err, deadline = "", time.monotonic() + 30
        while "\n" not in err and time.monotonic() < deadline:
            time.sleep(0.02)
            err += capsys.readouterr().err
        said = re.fullmatch(rf"serving {MODEL} on http://127\.0\.0\.1:(\d+)/v1\n", err)
        assert said and int(said[1]) != 0, err
        assert httpx.get(f"http://127.0.0.1:{said[1]}/health", timeout=30).json()["status"] == "ok"
    finally:
        assert wait_until(lambda: bool(servers) and servers[0].started)
        servers[0].should_exit = True
        thread.join(timeout=30)
    assert exits == [0]


def test_a_chat_template_that_cannot_compile_refuses_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every chat request would fail, by no fault of the client's: serve says so in one line and exits 2."""
    lm = lm_with_template(tmp_path, "{% for m in messages %}{{ m.content }")
    with pytest.raises(ModelLoadError, match=r"chat template cannot be compiled: unexpected '}' \(line 1\)"):
        create_app(FakeEngine([1]), lm, model_name="m", manage_engine=False)
    monkeypatch.setattr(serve, "build", lambda args: create_app(FakeEngine([1]), lm, model_name="m"))
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moelane: error: the model's chat template cannot be compiled: unexpected '}' (line 1)"], err


def test_a_chat_template_that_refuses_the_messages_answers_400(tmp_path: Path) -> None:
    template = ("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the user\\'s') }}"
                "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")  # fmt: skip
    lm = lm_with_template(tmp_path, template)
    with running(create_app(FakeEngine([5, 6]), lm, model_name="m", max_streams=4, manage_engine=False)) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
        body["messages"].append({"role": "assistant", "content": "hello"})
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "refused the messages: the last message must be the user's" in error["message"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "messages", "invalid_value")
