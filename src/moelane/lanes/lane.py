"""The engine's private state for one stream: its tokens, KV cache, position, drafts and acceptance.

Invariants: `tokens` is the prompt followed by the committed reply and only grows; the cache holds valid K/V for
positions `0..n_fed-1`, which are `tokens[:n_fed]`; the rows still to feed are `tokens[n_fed:]` (the prompt while
prefilling, then the one last committed token) followed by any drafts. Drafts are proposals for the tokens after
`tokens`; they never enter `tokens` unless the model itself produces them at their rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moelane.lanes.depth import Acceptance
from moelane.lanes.stream import Stream
from moelane.model.sampling import SamplingParams


@dataclass(slots=True, eq=False)
class Lane:
    stream: Stream
    params: SamplingParams
    stop_ids: frozenset[int]
    cache: Any  # None until the stream is admitted
    acceptance: Acceptance
    tokens: list[int] = field(default_factory=list)
    n_prompt: int = 0
    n_fed: int = 0
    drafts: list[int] = field(default_factory=list)
    drafted_at: int = -1  # len(tokens) when drafts were last proposed (a stream is drafted once per new token)
    last_round: int = -1  # the last round this lane took part in (least recently served goes first)
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's, with the n most likely
    prompt_logprobs: bool = False  # the prompt's tokens' too (with `top_logprobs` alternatives)

    @property
    def id(self) -> int:
        return self.stream.id

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def n_pending(self) -> int:
        """Tokens to feed before the model's next token can be read: prompt left to prefill, or the last token."""
        return len(self.tokens) - self.n_fed

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are still to be fed."""
        return self.n_fed < self.n_prompt

    @property
    def decoding(self) -> bool:
        return self.n_pending == 1

    @property
    def room(self) -> int:
        """The most drafts worth holding: the reply can grow by this many tokens beyond the model's own."""
        return max(0, self.stream.max_tokens - self.n_generated - 1)
