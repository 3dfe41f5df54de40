"""Chat replies with reasoning: gpt-oss's channels (the final channel is the content, the analysis channel the
reasoning) and `<think>` tags (Qwen3, DeepSeek-R1); the markup between them is dropped, however the tokens group
into rounds; completions keep the raw text. The chat template's own variables (`chat_template_kwargs`,
`reasoning_effort`) reach it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from moelane.model import reasoning
from moelane.model.reasoning import Channels, ThinkTags
from moelane.model.tokenizer import Tokenizer
from moelane.server.app import create_app
from moelane.server.generation import Generation, GenerationParams, Limits, Reasoning
from tests.helpers import CHAT_TEMPLATE, write_harmony_tokenizer, write_think_tokenizer, write_tokenizer
from tests.server.conftest import running
from tests.server.fake_engine import FakeEngine, FakeLM

TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "<|start|>assistant")  # fmt: skip
THOUGHT, ANSWER = "The user wants a fibonacci function.", "def fibonacci(n): return n"


@pytest.fixture(scope="module")
def harmony_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test tokenizer with gpt-oss's channel tokens (harmony) and a chat template ending as gpt-oss's does."""
    return write_harmony_tokenizer(tmp_path_factory.mktemp("harmony"), TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(harmony_folder: Path) -> Tokenizer:
    return Tokenizer(harmony_folder, frozenset())


def harmony_reply(tok: Tokenizer, final: str = ANSWER) -> list[int]:
    def special(name: str) -> int:
        tid = tok.token_id(name)
        assert tid is not None
        return tid

    return [special("<|channel|>"), *tok.encode("analysis"), special("<|message|>"), *tok.encode(THOUGHT),
            special("<|end|>"), special("<|start|>"), *tok.encode("assistant"), special("<|channel|>"),
            *tok.encode("final"), special("<|constrain|>"), *tok.encode("text"), special("<|message|>"),
            *tok.encode(final), special("<|return|>")]  # fmt: skip


def run(engine: FakeEngine, tok: Tokenizer, split: bool, stops: tuple[str, ...] = (),
        prompt: tuple[int, ...] = (1, 2)) -> list[str]:  # fmt: skip
    gen = Generation(engine, tok, GenerationParams(prompt, 500, stops=stops, reasoning=split), Limits())

    async def collect() -> list[str]:
        return [p async for p in gen.run()]

    return asyncio.run(collect())


@pytest.mark.parametrize("per_round", [1, 3, 64])
def test_a_reply_splits_into_reasoning_and_content(tokenizer: Tokenizer, per_round: int) -> None:
    reply = harmony_reply(tokenizer)
    pieces = run(FakeEngine(reply, per_round), tokenizer, split=True)
    assert "".join(p for p in pieces if isinstance(p, Reasoning)) == THOUGHT
    assert "".join(p for p in pieces if not isinstance(p, Reasoning)) == ANSWER
    cut = run(FakeEngine(reply, per_round), tokenizer, split=True, stops=("return",))
    assert "".join(p for p in cut if not isinstance(p, Reasoning)) == "def fibonacci(n): "
    raw = run(FakeEngine(reply, per_round), tokenizer, split=False)  # (completions: the text as decoded)
    assert "".join(raw) == tokenizer.decode(reply) and not any(isinstance(p, Reasoning) for p in raw)


def test_channels_need_the_special_tokens(tokenizer: Tokenizer, tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    assert Channels.for_tokenizer(Tokenizer(tmp_path, frozenset())) is None
    channels = Channels.for_tokenizer(tokenizer)
    assert channels is not None
    said = [channels.push(t) for t in harmony_reply(tokenizer)]
    assert {s for s in said if s} == {reasoning.ANSWER, reasoning.REASONING}


REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "fib?"}], "max_tokens": 200}


def app_over(engine: FakeEngine, tokenizer: Tokenizer) -> Any:
    """The server app over a scripted engine (its reply for every request) and `tokenizer`."""
    return create_app(engine, FakeLM(tokenizer), model_name="m", max_streams=4, manage_engine=False)


def test_the_chat_api_gives_reasoning_content(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(harmony_reply(tokenizer), per_round=2)
    request = REQUEST
    with running(app_over(engine, tokenizer)) as base:
        body = httpx.post(f"{base}/v1/chat/completions", json=request, timeout=30).json()
        message = body["choices"][0]["message"]
        assert message["content"] == ANSWER and message["reasoning_content"] == THOUGHT
        assert body["usage"]["completion_tokens"] == len(engine.reply)
        content, thought = "", ""
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**request, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        content += choice["delta"].get("content") or ""
                        thought += choice["delta"].get("reasoning_content") or ""
        assert content == ANSWER and thought == THOUGHT
        completion = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 200},
                                timeout=30).json()  # fmt: skip
        assert completion["choices"][0]["text"] == tokenizer.decode(engine.reply)


@pytest.fixture
def harmony_model(tmp_path: Path, harmony_folder: Path) -> Path:
    """A random gpt-oss model with the harmony test tokenizer."""
    import shutil

    from tests.helpers import random_model

    folder = random_model("gpt_oss", tmp_path / "m", vocab_size=320)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(harmony_folder / name, folder / name)
    return folder


def test_run_chat_prints_the_final_channel_and_reasoning_apart(
    tokenizer: Tokenizer, harmony_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moelane run --chat`: the answer on stdout, the reasoning on stderr (the model's reply scripted)."""
    import moelane.commands
    import moelane.commands.run

    reply = harmony_reply(tokenizer)
    monkeypatch.setattr(moelane.commands.run, "generate", lambda *args: iter(reply))
    assert moelane.commands.main(["run", "--model", str(harmony_model), "--chat", "--compile", "off", "fib?"]) == 0
    out, err = capsys.readouterr()
    assert out == ANSWER + "\n" and THOUGHT in err and "final" not in err


def test_run_chat_json_answers_at_once(
    tokenizer: Tokenizer, harmony_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moelane run --chat --json` on gpt-oss: the prompt ends with the final channel's opening, which the reply's
    channels start from, so the (scripted) JSON is the answer on stdout; the reply is held to JSON."""
    import moelane.commands
    import moelane.commands.run
    from moelane.model.reasoning import FINAL_OPENING

    reply, asked = tokenizer.encode('{"n": 1}'), []
    monkeypatch.setattr(moelane.commands.run, "generate", lambda lm, ids, args, params: asked.append((ids, params))
                        or iter(reply))  # fmt: skip
    argv = ["run", "--model", str(harmony_model), "--chat", "--json", "--compile", "off", "fib?"]
    assert moelane.commands.main(argv) == 0
    out = capsys.readouterr().out
    ids, params = asked[0]
    opening = tokenizer.encode(FINAL_OPENING)
    assert ids[-len(opening) :] == opening and params.grammar is not None
    assert out == '{"n": 1}\n'


THINKING = ("{% if reasoning_effort is defined %}effort {{ reasoning_effort }}{% endif %}" + CHAT_TEMPLATE
            + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The test tokenizer with Qwen3's think tags (added tokens, not special: they decode as text)."""
    return Tokenizer(write_think_tokenizer(tmp_path_factory.mktemp("think"), THINKING), frozenset())


def think_reply(tok: Tokenizer, opened: bool = False) -> list[int]:
    start, end = tok.token_id("<think>"), tok.token_id("</think>")
    assert start is not None and end is not None
    return [*([] if opened else [start]), *tok.encode("\n" + THOUGHT + "\n"), end, *tok.encode("\n\n" + ANSWER)]


@pytest.mark.parametrize("per_round", [1, 4, 64])
def test_think_tags_split_reasoning_from_the_answer(thinker: Tokenizer, per_round: int) -> None:
    def parts(reply: list[int], prompt: tuple[int, ...] = (1, 2)) -> tuple[str, str]:
        pieces = run(FakeEngine(reply, per_round), thinker, split=True, prompt=prompt)
        return ("".join(p for p in pieces if isinstance(p, Reasoning)),
                "".join(p for p in pieces if not isinstance(p, Reasoning)))  # fmt: skip

    assert parts(think_reply(thinker)) == (THOUGHT + "\n", ANSWER)  # the whitespace opening each part dropped
    opened = (1, *thinker.encode("x"), thinker.token_id("<think>"))  # DeepSeek-R1: the prompt opens the block
    assert parts(think_reply(thinker, opened=True), opened) == (THOUGHT + "\n", ANSWER)  # type: ignore[arg-type]
    closed = (*opened, thinker.token_id("</think>"))  # Qwen3 with thinking off: an empty block in the prompt
    plain = thinker.encode("just an answer")
    assert parts(plain, closed) == ("", "just an answer")  # type: ignore[arg-type]
    assert ThinkTags.for_tokenizer(thinker, [1, 2]) is not None and Channels.for_tokenizer(thinker) is None


def test_template_variables_reach_the_template(thinker: Tokenizer) -> None:
    engine = FakeEngine(think_reply(thinker), per_round=3)
    request = REQUEST
    with running(app_over(engine, thinker)) as base:
        body = httpx.post(f"{base}/v1/chat/completions", json=request, timeout=30).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER,
                                                 "reasoning_content": THOUGHT + "\n"}  # fmt: skip
        off = {**request, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
        assert httpx.post(f"{base}/v1/chat/completions", json=off, timeout=30).status_code == 200
        prompts = [thinker.decode(s.prompt_ids) for s in engine.streams]
        assert not prompts[0].endswith("</think>\n\n") and "effort" not in prompts[0]
        assert prompts[1].startswith("effort low") and prompts[1].endswith("<think>\n\n</think>\n\n")
        bad = httpx.post(f"{base}/v1/chat/completions", json={**request, "chat_template_kwargs": {"messages": []}},
                         timeout=30)  # fmt: skip
        assert bad.status_code == 400 and "may not set messages" in bad.json()["error"]["message"]
        for effort in ("none", "xhigh"):  # (values OpenAI's API takes, which the openai client's types allow)
            assert httpx.post(f"{base}/v1/chat/completions", json={**request, "reasoning_effort": effort},
                              timeout=30).status_code == 200  # fmt: skip
        assert "effort xhigh" in thinker.decode(engine.streams[-1].prompt_ids)


def test_a_reply_without_reasoning_says_nothing_of_it(thinker: Tokenizer) -> None:
    """A chat reply with no reasoning has no `reasoning_content` key, as OpenAI's replies have none."""
    engine = FakeEngine(thinker.encode(ANSWER), per_round=2)
    with running(app_over(engine, thinker)) as base:
        body = httpx.post(f"{base}/v1/chat/completions", json=REQUEST, timeout=30).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}


def test_run_chat_drops_the_whitespace_that_opens_each_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moelane run --chat` with think tags: `<think>\\n` and `</think>\\n\\n` leave no blank lines before the
    reasoning or the answer, as the server sends them."""
    from tokenizers import Tokenizer as HfTokenizer

    import moelane.commands
    import moelane.commands.run
    from tests.helpers import random_model

    folder = random_model("qwen3_moe", tmp_path / "m", vocab_size=310)
    tok = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(folder / "tokenizer.json"))
    reply = think_reply(Tokenizer(folder, frozenset()))
    monkeypatch.setattr(moelane.commands.run, "generate", lambda *args: iter(reply))
    capsys.readouterr()  # (what saving the model printed)
    assert moelane.commands.main(["run", "--model", str(folder), "--chat", "--compile", "off", "fib?"]) == 0
    out, err = capsys.readouterr()
    assert out == ANSWER + "\n" and err.startswith(THOUGHT + "\n\n")
