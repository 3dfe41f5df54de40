"""Launching: a lone `moelane run` imports nothing distributed; `torchrun -m moelane run` on 2 ranks prints what one
process prints (slow); a placement that cannot be made, or placement flags that do not go together, stop the run
in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moelane.commands import main
from tests.distributed.helpers import Logits, Rank, free_port, launch

LONE = """
import sys
from moelane.commands import main
code = main(sys.argv[1:])
assert code == 0, code
print(sorted(m for m in sys.modules if m.startswith(("moelane.dist", "moelane.commands.distributed"))))
"""


def lone_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def test_a_lone_run_imports_nothing_distributed(tiny: Path) -> None:
    args = ["run", "hello", "--model", str(tiny), "--max-tokens", "2", "--threads", "1"]
    out = subprocess.run([sys.executable, "-c", LONE, *args], capture_output=True, text=True, env=lone_env(),
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_torchrun_run_prints_what_one_process_prints(tiny: Path) -> None:
    args = ["run", "hello world", "--model", str(tiny), "--max-tokens", "12", "--drafter", "copy"]
    one = subprocess.run([sys.executable, "-m", "moelane", *args], capture_output=True, text=True, env=lone_env(),
                         timeout=120)  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "moelane"]  # fmt: skip
    two = subprocess.run([*torchrun, *args, "--stats"], capture_output=True, text=True, env=lone_env(), timeout=240)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()
    assert "experts over 2 ranks (rank 0 [0, 5), rank 1 [5, 10) of 10 a layer)" in two.stderr


def test_a_placement_rank_0_cannot_make_stops_every_rank_with_its_line(tiny: Path, tmp_path: Path) -> None:
    missing = tmp_path / "none.trc"
    got = launch(tiny, Logits([[1, 2]]), [Rank({"placement_trace": missing}), Rank()])
    assert got[:3] == ("error", 0, "InputError") and got[3] == f"placement trace {missing}: no such file"


def test_placement_flags_that_do_not_go_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--placement", "balanced"], "this process runs alone"),
        (["--placement-trace", "x.trc"], "--placement-trace is read with --placement balanced only"),
    ]
    for args, said in cases:
        assert main(["run", "hi", "--max-tokens", "1", *args]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1
