"""The expert pager: which experts are in fast memory, when, and at what precision (docs/pager.md).

Two sides speak the same formats:

- `live/`: the expert store a running model uses (an `ExpertProvider` under a hard byte budget: pool slots, storage
  levels, precision tiers, prefetch, statistics), how a run's settings build it (`live/build.py`, `live/memory.py`),
  and the trace recorder, which hooks a live model.
- `lab/`: offline work on recorded traces, no model needed: analytics, replay of residency policies with a cost
  model, Belady's optimum, pool-size sweeps, synthetic traces, plots.

The seam between them is this package's top level: the formats, `trace.py` (routing traces, which live records and
lab reads) and `plan.py` (the plain-data plan a policy publishes and the store obeys); and the policy both sides run,
`planner.py` with `scoreboard.py` and `segment.py` (the live store drives it from a model's routing, replay from a
trace), and the rule both sides load predictions by, `price.py`. It sits here, not in either side, so that each side
imports it and neither imports the other.

Imports: the top level imports neither side; `live` imports the top level and the model, `lab` the top level alone
(both `moelane.errors` too); `live` never imports `lab`, nor `lab` `live` (tests/test_layers.py checks it).
"""
