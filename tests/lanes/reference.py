"""The reference every lanes reply must equal: one-token decode of the prompt alone (as `LM.generate_ids`), written
against the target protocol so that it runs on the fake target and on `LM` alike."""

from __future__ import annotations

from typing import Any

from moelane.model.cache import Rows
from moelane.model.sampling import SamplingParams, sample


def solo_decode(
    target: Any, prompt: list[int], max_tokens: int, params: SamplingParams, stop_ids: frozenset[int] | None = None
) -> list[int]:
    stop_ids = target.eos_ids if stop_ids is None else stop_ids
    cache = target.cache_for(len(prompt), max_tokens)
    logits = target.forward([Rows(cache, list(prompt), 0)])[0][-1]
    out: list[int] = []
    position = len(prompt)
    for i in range(max_tokens):
        token = sample(logits, params, position, out)
        if token in stop_ids:
            break
        out.append(token)
        if i + 1 < max_tokens:
            logits = target.forward([Rows(cache, [token], position, decode=True)])[0][-1]
        position += 1
    return out


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` varied prompts: different lengths, some repetitive (copy-friendly), some not."""
    out = []
    for i in range(n):
        length = 3 + (i * 7 + seed) % 29
        if i % 3 == 0:
            unit = [(i * 5 + j * 11 + seed) % (vocab - 1) + 1 for j in range(4 + i % 5)]
            out.append((unit * (length // len(unit) + 2))[:length])
        else:
            out.append([(i * 13 + j * j * 7 + seed) % (vocab - 1) + 1 for j in range(length)])
    return out
