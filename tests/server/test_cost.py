"""Per-request pager cost: each pass's change in the store's counters is split among the streams in that pass by
their rows, so the requests' bills add up to the store's totals; the accesses go to the pass's phase as the model
labels it; the accesses of passes in which a stream fed prompt rows count as prefill, the others as decode;
metrics registries are per app."""

from __future__ import annotations

from types import SimpleNamespace

from moelane.pager.live.stats import PagerStats
from moelane.server.cost import PagerLedger
from moelane.server.metrics import ServerMetrics


def test_ledger_splits_each_pass_by_rows_and_adds_up() -> None:
    stats = PagerStats()
    ledger = PagerLedger(SimpleNamespace(stats=stats))
    for stream_id, n_prompt, n_cached in ((0, 5, 2), (1, 1, 0)):
        ledger.track(SimpleNamespace(id=stream_id, prompt_ids=[7] * n_prompt, n_cached=n_cached, token_ids=[]))
    # pass 1, both prompts (stream 0's 3 rows after its cached 2, stream 1's 1): 4 experts read, 4000 bytes, 0.2 s stall
    for _ in range(4):
        stats.add_read("disk", "native", 1000)
    stats.phase("prefill").stall_s += 0.2
    stats.phase("prefill").misses += 4
    stats.phase("prefill").hits += 2
    ledger.observe(SimpleNamespace(stream_ids=(0, 0, 0, 1)))
    # pass 2: stream 1 alone; 2 experts from host at int8
    stats.add_read("host", "int8", 500)
    stats.add_read("host", "int8", 500)
    stats.phase("decode").misses += 2
    stats.phase("decode").prefetch_hits += 1
    ledger.observe(SimpleNamespace(stream_ids=(1,)))
    # pass 3: nothing read; two streams decoding, which the store counts as a prefill pass (more than one row)
    stats.phase("prefill").hits += 3
    ledger.observe(SimpleNamespace(stream_ids=(0, 1)))
    a, b = ledger.cost_of(SimpleNamespace(id=0)), ledger.cost_of(SimpleNamespace(id=1))
    assert (a.experts_fetched, a.bytes_fetched, round(a.stall_ms)) == (3, 3000, 150)
    assert (b.experts_fetched, b.bytes_fetched, round(b.stall_ms)) == (3, 2000, 50)
    assert a.bytes_fetched + b.bytes_fetched == sum(stats.bytes_read.values())
    assert ledger.cost_of(SimpleNamespace(id=7)).experts_fetched == 0
    phases = ledger.phases()
    assert phases["prefill"] == {"found": 2, "accesses": 6, "stall_s": 0.2}
    assert phases["decode"] == {"found": 4, "accesses": 6, "stall_s": 0.0}


def test_a_pass_is_prefill_while_a_stream_in_it_feeds_its_prompt() -> None:
    stats = PagerStats()
    ledger = PagerLedger(SimpleNamespace(stats=stats))
    ledger.track(SimpleNamespace(id=3, prompt_ids=[7] * 6, n_cached=0, token_ids=[]))
    ledger.track(SimpleNamespace(id=4, prompt_ids=[7] * 2, n_cached=0, token_ids=[9]))  # (its prompt already ran)
    phases = []
    for rows in ((3, 3, 3, 3), (3, 3, 4), (3, 3, 3, 4, 4)):  # a prompt in two chunks, then a stream's drafts
        stats.phase("prefill").misses += 1
        ledger.observe(SimpleNamespace(stream_ids=rows))
        phases.append({name: c["accesses"] for name, c in ledger.phases().items()})
    assert phases == [{"prefill": 1}, {"prefill": 2}, {"prefill": 2, "decode": 1}]


def test_metrics_registries_are_per_app_and_show_pager_levels() -> None:
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(rounds=3, holds=4, accepted=2, committed=9,
                                                           prefill_tokens=5, finished=1, n_active=0, n_waiting=2,
                                                           guard_modes={1: "drafted", 8: "plain"}))  # fmt: skip
    stats = PagerStats()
    stats.add_read("disk", "int4", 123)
    one, two = ServerMetrics(engine, stats.to_dict), ServerMetrics(engine)
    one.completion_tokens.inc(5)
    text_one, text_two = one.render().decode(), two.render().decode()
    assert "moelane_completion_tokens_total 5.0" in text_one and "moelane_completion_tokens_total 0.0" in text_two
    assert 'moelane_pager_bytes_read_total{level="disk",precision="int4"} 123.0' in text_one
    assert "moelane_engine_acceptance 0.5" in text_one and "moelane_queue_depth 2.0" in text_one
    assert 'moelane_guard_drafted{streams="1"} 1.0' in text_one and 'moelane_guard_drafted{streams="8"} 0.0' in text_one
