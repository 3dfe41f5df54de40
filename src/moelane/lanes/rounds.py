"""The steps of one round, as plain functions over lanes: choose, plan windows, verify, commit.

- `choose`: the streams taking part, least recently served first, each with its base rows (the one pending token of
  a decoding stream, or a chunk of a prefilling stream's prompt), within the stream and row limits.
- `plan_windows`: adds draft rows by the depth rule (drafts are held only in drafted rounds).
- `verify`: the model's own token at each row from the first row that predicts a new token; the longest prefix of
  drafts equal to those tokens is accepted, plus the model's token after it. Tokens come from `sample(logits,
  params, absolute position)`, so a drafted row yields exactly what a one-token step would.
- `commit`: appends the committed tokens (cut at a stop token or at max_tokens), moves the lane's fed position past
  the rows that stay valid; rejected rows are rolled back by simply feeding later rows from an earlier position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelane.lanes.depth import Prices, Seat, allocate
from moelane.lanes.lane import Lane
from moelane.lanes.stream import TokenLogprob
from moelane.model.cache import Rows
from moelane.model.sampling import argmax_rows, sample


@dataclass(slots=True)
class Window:
    """One lane's rows in a round: `feed` (pending tokens) then `drafts` (held drafts)."""

    lane: Lane
    feed: list[int]
    drafts: list[int]

    @property
    def commits(self) -> bool:
        """Whether the model's next token is read this round (the lane's pending tokens all fit)."""
        return self.lane.n_fed + len(self.feed) == len(self.lane.tokens)

    def rows(self) -> Rows:
        lane = self.lane  # once the prompt is fed, every row is a generated token: the last committed, then drafts
        return Rows(lane.cache, self.feed + self.drafts, lane.n_fed, lane.id, decode=not lane.prefilling)


def choose(lanes: Sequence[Lane], max_streams: int, max_rows: int, prefill_chunk: int) -> list[tuple[Lane, int]]:
    """(lane, base rows) of the streams in the next round, least recently served first."""
    order = sorted(lanes, key=lambda lane: lane.last_round)[:max_streams]
    spare = max_rows - sum(1 for lane in order if lane.decoding)
    chosen: list[tuple[Lane, int]] = []
    for lane in order:
        if lane.decoding:
            if len(chosen) < max_rows:
                chosen.append((lane, 1))
            continue
        n = min(lane.n_pending, prefill_chunk, spare)
        if n > 0:
            chosen.append((lane, n))
            spare -= n
    return chosen


def plan_windows(
    chosen: Sequence[tuple[Lane, int]], drafted: bool, prices: Prices, max_rows: int, probe: bool = False
) -> list[Window]:
    seats = [
        Seat(base, lane.n_fed + base == len(lane.tokens), min(len(lane.drafts), lane.room) if drafted else 0,
             lane.acceptance)
        for lane, base in chosen
    ]  # fmt: skip
    depths = allocate(seats, prices, max_rows, probe=probe) if drafted else [0] * len(seats)
    return [
        Window(lane, lane.tokens[lane.n_fed : lane.n_fed + base], lane.drafts[:depth])
        for (lane, base), depth in zip(chosen, depths, strict=True)
    ]


def verify(window: Window, logits: torch.Tensor) -> list[int]:
    """The committed tokens of a window, from its logits [rows, vocab] (or only the rows from its last fed token on,
    as a pass with `last_only` gives when no window holds drafts)."""
    if not window.commits:
        return []
    lane, first = window.lane, logits.shape[0] - 1 - len(window.drafts)
    params, position = lane.params, len(lane.tokens)
    plain_argmax = params.greedy and not params.adjusts
    model_ids = argmax_rows(logits[first:]) if plain_argmax else []
    reply = lane.tokens[lane.n_prompt :] if params.adjusts else []
    out: list[int] = []
    for j in range(len(window.drafts) + 1):
        token = model_ids[j] if plain_argmax else sample(logits[first + j], params, position + j, reply + out)
        out.append(token)
        if j == len(window.drafts) or window.drafts[j] != token:
            break
    return out


def logprobs_of(window: Window, logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """The log-probability of each committed token (`verify`'s) under the raw logits of the row that chose it, with
    the `n_top` most likely tokens there."""
    first = logits.shape[0] - 1 - len(window.drafts)
    return _logprobs(logits[first : first + len(tokens)], tokens, n_top)


def prompt_logprobs_of(window: Window, logits: torch.Tensor, n_top: int) -> list[TokenLogprob | None]:
    """For a prefill window (logits of all its rows): the log-probability of each prompt token its rows predict,
    led by None for the prompt's first token when the window starts the prompt."""
    lane = window.lane
    n = max(0, min(len(window.feed), lane.n_prompt - lane.n_fed - 1))  # rows whose next token is the prompt's
    lead: list[TokenLogprob | None] = [None] if lane.n_fed == 0 else []
    return lead + list(_logprobs(logits[:n], lane.tokens[lane.n_fed + 1 : lane.n_fed + 1 + n], n_top))


def _logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """Row i's log-softmax at tokens[i], and its `n_top` most likely tokens."""
    if not tokens:
        return []
    rows = torch.log_softmax(logits.float(), dim=-1)
    chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if not n_top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    values, ids = torch.topk(rows, min(n_top, rows.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)
    ]


def commit(window: Window, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> str | None:
    """Append a window's committed tokens (and their `logprobs_of`, if asked for) to its lane; the finish reason if
    the stream ends here."""
    lane = window.lane
    if not window.commits:
        lane.n_fed += len(window.feed)
        return None
    old_len = len(lane.tokens)
    kept: list[int] = []
    reason = None
    for token in tokens:
        if token in lane.stop_ids:
            reason = "stop"
            break
        kept.append(token)
        if lane.n_generated + len(kept) >= lane.stream.max_tokens:
            reason = "length"
            break
    lane.tokens.extend(kept)
    lane.n_fed = old_len + len(tokens) - 1  # the accepted drafts' rows stay valid; the model's token is pending
    lane.drafts = []
    lane.stream._append(kept, logprobs[: len(kept)] if logprobs is not None else None)
    return reason
