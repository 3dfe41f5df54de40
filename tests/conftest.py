"""The README's test loop (`pytest -m "not slow"`) is held to 3 minutes on a 2-core machine: the tests named here are
marked `slow` at collection, besides those marked in their files, and `.ci/run` runs them with the rest of `-m slow`.

A parametrized test keeps its first `SAMPLED` cases in the loop (those in `FEWER` their own number; family parity
keeps each family's first config).
Each of the others is a second case of what a fast test already asserts (another variant of a family, another tool
syntax or bad request, a second stream count or drafter, a second path through the command line), or a
multi-process test whose fast sibling stays.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import OWN_CACHE_FAMILIES

# `MOELANE_TEST_DEVICE=cuda pytest ...` (bench/device_check.sh): every model the tests load with `moelane.load` and no
# device of their own computes there, so the parity and identity tests take a device parameter.
TEST_DEVICE = os.environ.get("MOELANE_TEST_DEVICE")

# nodeid prefixes (a test, a parametrized case, or a whole file)
SLOW_IN_THE_FAST_LOOP = (
    # distributed: the identity tests stay fast; the per-rank counters, a killed rank, a refused one, a lone run's
    # imports and a placement rank 0 cannot make start processes of their own (seconds each) and are slow
    "tests/distributed/test_counters.py",
    "tests/distributed/test_faults.py::test_a_rank_lost_mid_request_fails_it_within_the_timeout",
    "tests/distributed/test_faults.py::test_a_rank_with_another_model_is_refused",
    "tests/distributed/test_launch.py::test_a_lone_run_imports_nothing_distributed",
    "tests/distributed/test_launch.py::test_a_placement_rank_0_cannot_make_stops_every_rank_with_its_line",
    # a grammar's replies against one-token decoding (its replies meeting the schema stay fast), and a 499 counted
    # after a streamed disconnect (the other disconnect tests stay fast)
    "tests/model/test_grammar.py::test_engine_replies_under_a_grammar_equal_one_token_decoding",
    "tests/server/test_clients.py::test_streamed_disconnect_is_counted_as_499",
    # a second stream or drafter case of the identity and prefix tests
    "tests/pager/test_store_concurrency.py::test_eight_streams_at_ten_percent[True-False]",
    "tests/model/test_gguf_codes.py::test_replies_equal_solo_decode_at_any_stream_count[paged-q8_0]",
    "tests/lanes/test_prefix.py::test_many_streams_sharing_prefixes_in_waves_reply_as_alone[recall]",
    # second paths through the command line
    "tests/test_cli_inputs.py::test_run_drafts_by_default_and_replies_the_same",
    "tests/server/test_load.py::test_disconnect_mid_stream_frees_the_stream",
    "tests/pager/test_store.py::test_an_engine_fits_its_rounds_to_a_small_pool",
    "tests/server/test_errors.py::test_bad_request_gets_clear_4xx[bias of more tokens than any vocabulary]",
    # compiled identity: the compiled rows' own tests stay fast
    "tests/lanes/test_engine_lm.py::test_compiled_model_replies_equal_its_compiled_solo_decode",
    "tests/model/test_core.py::test_compiled_rows_do_not_depend_on_what_shares_the_call[1]",
    # a second engine case: two ranks under the default placement, the copy drafter greedy
    "tests/distributed/test_identity.py::test_two_ranks_reply_as_one_process_under_a_balanced_placement",
    # the shipped fixtures and the inflated model's claim, read again by the benchmarks' own runs
    "tests/pager/test_fixtures.py::test_default_model_fixture_reads_and_replays",
    "tests/test_inflate.py::test_same_greedy_replies",
    # a CPU run leaves CUDA alone: subprocesses that load a model (the meta-device passes stay fast); the compiled
    # step on the meta device: its eager passes stay fast
    "tests/test_device.py::test_a_cpu_run_never_touches_cuda",
    "tests/pager/test_store_device.py::test_a_cpu_store_does_not_initialise_cuda",
    "tests/test_device.py::test_the_compiled_step_on_another_device_makes_nothing_on_the_cpu",
    # On a slower 2-core machine (a 2.45 GHz EPYC, AVX2: the loop took 233 s where a Xeon took 130) these keep it
    # under 3 minutes. Processes that load a model to check one line or one exit (1.3-5.5 s each), whose library
    # paths fast tests cover: the commands' own arguments and messages stay in test_cli_inputs.py's fast tests
    "tests/pager/test_ceiling.py::test_below_the_minimum_it_refuses_in_one_line_naming_it",
    "tests/pager/test_limits.py::test_a_real_cgroup_limit_is_found_by_a_process_inside_it",
    "tests/pager/test_fitting.py::test_run_pages_what_does_not_fit_and_says_so",
    "tests/pager/test_commands.py::test_sigterm_stops_a_trace_command_as_ctrl_c_does",
    "tests/pager/test_commands.py::test_plot_needs_matplotlib_or_writes_a_png",
    "tests/server/test_commands.py::test_ctrl_c_while_loading_interrupts_at_once",
    "tests/test_cli_inputs.py::test_run_holds_the_reply_to_a_json_schema",
    "tests/test_cli_inputs.py::test_run_says_when_the_context_cuts_the_reply",
    "tests/test_cli_inputs.py::test_replay_pool_sizes_as_run_takes_them",
    "tests/test_cli_inputs.py::test_analyze_leaves_out_a_predictor_too_big_for_memory",
    "tests/test_cli_inputs.py::test_replay_shows_the_pool_in_slots_and_bytes_however_it_was_given",
    "tests/test_cli_inputs.py::test_a_decode_step_that_cannot_compile_runs_eagerly",
    "tests/model/test_core.py::test_cli_run_with_a_drafter_prints_the_very_same_reply",
    "tests/model/test_core.py::test_a_character_cut_off_by_max_tokens_ends_the_text_as_run_prints_it",
    # ... and second cases of what fast tests assert: a conversation across turns and families' own caches (each
    # family's engine identity stays fast), the OpenAI client on a strict schema (the schema tests stay fast), a
    # model's large pools advised (a placed pool's bits stay), the default model's routing (its parity stays), one
    # cache bound
    "tests/lanes/test_prefix.py::test_the_shipped_model_replies_as_alone_across_turns",
    "tests/lanes/test_prefix.py::test_families_whose_cache_is_not_plain_kv_reuse_it[deepseek",
    "tests/lanes/test_prefix.py::test_families_whose_cache_is_not_plain_kv_reuse_it[lfm2",
    "tests/lanes/test_prefix_bounds.py::test_a_cache_that_cannot_be_allocated_beside_kept_ones_drops_them",
    "tests/server/test_json.py::test_the_openai_client_parses_a_strict_schema_reply",
    "tests/kernels/test_hugepages.py::test_a_model_with_large_pools_holds_them_advised_and_computes_the_same",
    "tests/model/test_default_model.py::test_routing_is_not_degenerate",
    # paged and threaded prefix reuse (the plain reuse tests stay), the analyze page (the trace views stay), a 429
    # (the other load tests stay)
    "tests/lanes/test_prefix.py::test_a_paged_target_reuses_caches",
    "tests/lanes/test_prefix.py::test_a_threaded_engine_with_overlap_reuses_caches",
    "tests/pager/test_report.py::test_analyze_writes_one_self_contained_page",
    "tests/server/test_load.py::test_overload_gets_429_and_the_queued_complete",
    # a json_object reply and a mask's independence (the schema replies stay), the import-cycle check (a process of
    # its own), the demo notice (the CLI's own tests stay), the router lookahead against transformers (the replay's
    # stays), lfm2's rolled-back convolutions (the engine identity tests stay), the untimed schedule (the timed one
    # stays)
    "tests/model/test_grammar.py::test_any_json_object",
    "tests/model/test_grammar.py::test_a_mask_depends_on_the_reply_alone",
    "tests/test_layers.py::test_moelane_has_no_import_cycle",
    "tests/test_cli_inputs.py::test_the_shipped_model_is_said_to_be_a_demo_where_a_newcomer_looks",
    "tests/pager/test_record_live.py::test_recorded_lookahead_is_the_next_routers_top_k_as_transformers_computes_it",
    "tests/lanes/test_engine_lm.py::test_lfm2_convolutions_roll_back_with_rejected_drafts",
    "tests/lanes/test_engine_fake.py::test_untimed_schedule_ignores_the_clock",
)
# every family's first config stays fast (fp32 parity, bf16 prefill bit for bit); other configs' parity and the bf16
# greedy replies run with the slow set
FAMILY_PARITY = ("test_fp32_matches_transformers", "test_bf16_prefill_logits_are_transformers_bit_for_bit")
# ... but fp32 parity's KV-cache decode and greedy run (~0.9 s a family on the EPYC) stays fast only for the families
# with caches of their own, plain qwen3_moe, phimoe (LongRoPE switches factors at a decode position) and dense llama;
# the other families' first configs keep their bf16 prefill bit for bit in the loop
FP32_FAST_FAMILIES = OWN_CACHE_FAMILIES | {"qwen3_moe", "phimoe", "llama"}
BF16_GREEDY = "test_bf16_greedy_matches_transformers"
# each tool syntax's forced call stays fast with tool_choice "required"; by name it is slow
FORCED_BY_NAME = "test_tool_choice_forces_a_call_by_the_opening_the_prompt_ends_with"


# a parametrized test's first cases stay fast, the rest of its matrix runs with the slow set
SAMPLED = 2
FEWER = {  # tests that keep their own number of first cases (in collection order)
    "test_each_form_reads_back_what_its_template_writes": 3,  # hermes, qwen3_coder, glm45
    FORCED_BY_NAME: 6,  # the same three forms ("required"; by name is slow anyway)
    "test_harmony_calls_come_back_as_tool_calls": 2,  # two replies, one stream split
    "test_each_call_of_a_block_comes_back_with_its_id": 2,
    "test_a_marker_block_that_is_not_a_call_reads_as_without_tools": 2,
    "test_a_finished_reply_meets_the_schema": 2,  # one prompt, greedy and sampled
    "test_greedy_tokens_identical_at_every_budget": 1,  # 20% with staged misses
    "test_a_conversation_reuses_its_history_and_replies_as_alone": 2,  # no drafter, greedy and sampled
    "test_a_forced_call_is_held_to_the_tools_schema": 1,  # "required" (a named choice is the same grammar)
    "test_a_store_on_a_simulated_device_computes_what_the_cpu_store_does": 2,
}
# matrices of cheap cases that stay whole: every family's config errors, the kernels' reference
WHOLE = (
    "tests/model/test_config.py",
    "tests/kernels/",
    "tests/model/test_families.py::test_bad_configs_raise_model_load_error",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first: dict[str, str] = {}  # family -> its first case
    seen: dict[str, int] = {}  # test function -> its cases collected so far
    for item in items:
        if (
            isinstance(item, pytest.Function)
            and hasattr(item, "callspec")
            and item.originalname not in FAMILY_PARITY
            and not item.nodeid.startswith(WHOLE)
        ):
            seen[item.nodeid.partition("[")[0]] = n = seen.get(item.nodeid.partition("[")[0], 0) + 1
            if n > FEWER.get(item.originalname, SAMPLED):
                item.add_marker(pytest.mark.slow)
        named = item.nodeid.startswith(SLOW_IN_THE_FAST_LOOP) or getattr(item, "originalname", "") == BF16_GREEDY
        if named or a_later_config(item, first) or forced_by_name(item):
            item.add_marker(pytest.mark.slow)


def a_later_config(item: pytest.Item, first: dict[str, str]) -> bool:
    """A family parity case that is not its family's first (test_families.py's CASES, in order), or an fp32 one of a
    family outside FP32_FAST_FAMILIES."""
    if not isinstance(item, pytest.Function) or item.originalname not in FAMILY_PARITY:
        return False
    case, family = item.callspec.params["case"], item.callspec.params["family"]
    if item.originalname == FAMILY_PARITY[0] and family not in FP32_FAST_FAMILIES:
        return True
    return first.setdefault(family, case) != case


def forced_by_name(item: pytest.Item) -> bool:
    return isinstance(item, pytest.Function) and item.originalname == FORCED_BY_NAME and item.callspec.params["named"]


@pytest.fixture(autouse=True)
def _test_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Models loaded through `moelane.load` compute on TEST_DEVICE where one is set."""
    if TEST_DEVICE:
        import moelane
        import moelane.loading

        plain = moelane.loading.load

        @functools.wraps(plain)
        def on_device(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("device", TEST_DEVICE)
            return plain(*args, **kwargs)

        monkeypatch.setattr(moelane, "load", on_device)
        monkeypatch.setattr(moelane.loading, "load", on_device)
    yield
