"""A scripted stand-in for the lanes engine: each stream's reply is a fixed token list, committed `per_round` tokens
at a time on a thread of its own, so tests control exactly how tokens group into rounds; and `FakeLM`, the model
side the app reads (a tokenizer and its limits) for tests of a tokenizer without a model."""

from __future__ import annotations

import threading
import time
from typing import Any

from moelane.lanes.engine import EngineStats
from moelane.lanes.stream import Stream


class FakeEngine:
    def __init__(self, reply: list[int], per_round: int = 1, delay: float = 0.0) -> None:
        self.reply, self.per_round, self.delay = reply, per_round, delay
        self.streams: list[Stream] = []

    def submit(self, token_ids: list[int], max_tokens: int = 256, **_: Any) -> Stream:
        stream = Stream(len(self.streams), token_ids, max_tokens)
        self.streams.append(stream)
        threading.Thread(target=self._run, args=(stream,), daemon=True).start()
        return stream

    def _run(self, stream: Stream) -> None:
        reply = self.reply[: stream.max_tokens]
        for i in range(0, len(reply), self.per_round):
            if stream.cancel_requested:
                stream._finish("cancelled")
                return
            time.sleep(self.delay)
            stream._append(reply[i : i + self.per_round])
        stream._finish("length" if len(reply) == stream.max_tokens else "stop")

    @property
    def n_active(self) -> int:
        return sum(not s.done for s in self.streams)

    @property
    def n_waiting(self) -> int:
        return 0

    def stats(self) -> EngineStats:
        return EngineStats(n_active=self.n_active)


class FakeLM:
    """What the app reads of a model: its tokenizer, context, vocabulary and end-of-sequence ids (by default the
    test tokenizer's last id, its EOS)."""

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int] | None = None) -> None:
        self.tokenizer, self.max_context, self.vocab_size = tokenizer, 4096, tokenizer.vocab_size
        self.eos_ids = frozenset({tokenizer.vocab_size - 1}) if eos_ids is None else eos_ids
