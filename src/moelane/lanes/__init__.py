"""The lanes engine: many streams in shared rounds, speculative drafts where they pay, token-identical replies.

    engine = Engine(lm, EngineConfig(drafter="copy"))
    stream = engine.submit(prompt_ids, max_tokens=128)
    engine.run_until_idle()          # or engine.start() ... engine.stop() on a thread of its own
    stream.token_ids

See docs/lanes.md for the round, the depth rule and the guard.
"""

from moelane.lanes.clock import Clock, FakeClock, RealClock
from moelane.lanes.config import EngineConfig
from moelane.lanes.drafters import RecallStore
from moelane.lanes.engine import Engine, EngineStats
from moelane.lanes.stream import Stream, TokenLogprob
from moelane.lanes.target import Target

__all__ = [
    "Clock",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FakeClock",
    "RealClock",
    "RecallStore",
    "Stream",
    "Target",
    "TokenLogprob",
]
