"""bench/perplexity_bench.py's bookkeeping (no model, no llama.cpp): perplexities from summed log-likelihoods, the
GGUF labels, and the table's cells, moelane on a GGUF set against llama.cpp on the same file."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "perplexity_bench.py"


@pytest.fixture(scope="module")
def bench():  # bench/ is not a package
    spec = importlib.util.spec_from_file_location("bench_perplexity", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_perplexity_is_the_exp_of_the_mean_token_loss(bench) -> None:
    nll = {"code": [2.0 * 4, 4.0 * 4], "vimdoc": [3.0 * 4]}  # per window: summed over 4 tokens
    total, per = bench.perplexities(nll, 4)
    assert total == pytest.approx(math.exp(3.0))
    assert per == pytest.approx({"code": math.exp(3.0), "vimdoc": math.exp(3.0)})


def test_gguf_label_names_an_lm_head_of_another_type(bench) -> None:
    assert bench.gguf_label("q8_0", {"output.weight:Q8_0": 1, "token_embd.weight:Q8_0": 1}) == "Q8_0"
    assert bench.gguf_label("q4_0", {"output.weight:Q8_0": 1}) == "Q4_0, LM head Q8_0"
    assert bench.gguf_label("q4_0-out-q4_0", {"output.weight:Q4_0": 1}) == "Q4_0, LM head Q4_0"


def cells(label: str, ppl: float | None, gguf_ppl: float | None = None) -> dict:
    return {"label": label, "bytes": 2**20, "ppl": ppl, "gguf_bytes": 3 * 2**20 if gguf_ppl else None,
            "gguf_ppl": gguf_ppl}  # fmt: skip


def table(bench, rows: list[dict], capsys: pytest.CaptureFixture[str]) -> list[list[str]]:
    bench.print_table(rows)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_table_sets_moelane_on_the_gguf_against_llama_cpp_on_the_same_file(bench, capsys) -> None:
    rows = [
        {"name": "native", "label": "native", "bytes": 4 * 2**20, "ppl": 100.0, "files": [cells("F32", 100.0, 100.0)]},
        {"name": "int4", "label": "int4", "bytes": 2**20, "ppl": 104.0,
         "files": [cells("Q4_0, LM head Q8_0", 101.0, 102.01), cells("Q4_0, LM head Q4_0", 103.0, 103.0)]},
        {"name": "experts-int4", "label": "experts int4", "bytes": 2**20, "ppl": 100.5, "files": []},
    ]  # fmt: skip
    out = table(bench, rows, capsys)
    assert [len(r) for r in out] == [12] * 4
    assert out[1] == ["int4", "1.0 MiB", "104.000", "+4.00%", "Q4_0, LM head Q8_0", "1.0 MiB", "101.000", "+1.00%",
                      "+2.97%", "3.0 MiB", "102.010", "+1.00%"]  # fmt: skip
    assert out[2][-1] == "+0.00%" and out[3][4:] == ["-"] * 8


def test_table_without_the_folder_or_the_gguf_runs_shows_dashes(bench, capsys) -> None:
    """`--no-folder`: moelane's own cells are dashes; without `--moelane-gguf` the table keeps its nine columns."""
    rows = [{"name": "int8", "label": "int8", "bytes": None, "ppl": None, "files": [cells("Q8_0", 50.0, 50.5)]}]
    assert table(bench, rows, capsys)[0] == ["int8", "-", "-", "-", "Q8_0", "1.0 MiB", "50.000", "-", "-", "3.0 MiB",
                                             "50.500", "+1.00%"]  # fmt: skip
    rows[0]["files"] = [cells("Q8_0", 50.0)]
    assert table(bench, rows, capsys)[0] == ["int8", "-", "-", "-", "Q8_0", "1.0 MiB", "50.000", "-", "-"]
