"""`--device` on a machine without CUDA, and what a CUDA run needs that the CPU can check: the device module parses
and refuses in one line, `move` leaves no tensor behind, and a CPU run never initialises CUDA nor imports the device
kernels. What needs a GPU runs in bench/device_check.sh (and here, where one is present)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import moelane
from moelane.device import move, parse
from moelane.errors import InputError
from moelane.kernels import Pool
from moelane.model.cache import Rows
from moelane.model.lm import LM
from moelane.model.load import FAMILIES
from moelane.model.load import load as load_folder
from tests.helpers import random_model

from .test_cli_inputs import cli_error

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")


def test_cpu_and_nothing_parse_as_the_cpu() -> None:
    assert parse(None) == parse("cpu") == torch.device("cpu")


@pytest.mark.parametrize("text", ["tpu", "cuda:x", "gpu", "", "meta"])
def test_bad_devices_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(InputError) as e:
        parse(text)
    assert "\n" not in str(e.value) and "--device" in str(e.value)


@NO_CUDA
@pytest.mark.parametrize("text", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(InputError, match="CUDA"):
        parse(text)


@NO_CUDA
@pytest.mark.parametrize("command", ["run", "bench"])
def test_cli_device_cuda_without_cuda_is_one_line_and_exit_2(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command, "hello", "--device", "cuda"] if command == "run" else [command, "--device", "cuda"]
    assert "CUDA" in cli_error(argv, capsys)


def test_cli_device_typo_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--device" in cli_error(["run", "hello", "--device", "cuda:zero"], capsys)


def tensors_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a model holds: parameters, buffers, and those in plain attributes (kernel pools, dataclasses)."""
    found = [(name, t) for name, t in model.state_dict().items()]
    for mod_name, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                found.append((f"{mod_name}.{name}", value))
            elif isinstance(value, Pool) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
                for f in dataclasses.fields(value):
                    if isinstance(t := getattr(value, f.name), torch.Tensor):
                        found.append((f"{mod_name}.{name}.{f.name}", t))
    return found


@pytest.mark.parametrize(
    ("family", "quantize"), [("qwen3_moe", "none"), ("qwen3_moe", "int4"), ("phimoe", "int8"), ("gpt_oss", "none")]
)
def test_move_leaves_no_tensor_behind(family: str, quantize: str, tmp_path: Path) -> None:
    """Every tensor of a loaded model lands on the device (the meta device stands in for a GPU): parameters,
    buffers, quantised and float pools, rotary tables (phimoe's LongRoPE has two)."""
    overrides = {"rope_scaling": None} if family != "phimoe" else {}
    lm = load_folder(random_model(family, tmp_path, **overrides), quantize=quantize)
    found = tensors_of(lm.model)
    assert any(isinstance(v, Pool) for m in lm.model.modules() for v in vars(m).values()) or quantize == "none"
    move(lm.model, torch.device("meta"))
    left = [name for name, t in tensors_of(lm.model) if t.device.type != "meta"]
    assert not left and len(tensors_of(lm.model)) == len(found), left


def test_a_cpu_run_never_touches_cuda() -> None:
    """The default run imports no CUDA-specific module of moelane's and never initialises CUDA."""
    code = (
        "import sys, torch, moelane\n"
        "lm = moelane.load(compile=False)\n"
        "assert lm.device.type == 'cpu'\n"
        "print(''.join(lm.generate('def add(a, b):', max_tokens=4)) is not None)\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "assert 'moelane.kernels.cuda' not in sys.modules, 'device kernels imported'\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/device_check.sh runs it there)")
def test_the_shipped_model_on_cuda_replies_as_on_the_cpu() -> None:
    """Greedy replies of the shipped model on the GPU equal the CPU's (fp32: different kernels, the same argmax)."""
    cpu, gpu = moelane.load(device="cpu"), moelane.load(device="cuda")
    assert gpu.device.type == "cuda"
    prompt = cpu.tokenizer.encode("def fibonacci(n):")
    a = list(cpu.generate_ids(prompt, 24))
    b = list(gpu.generate_ids(prompt, 24))
    assert a == b


def test_device_out_of_memory_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU too small for what the flags ask: one line naming the way out, no traceback."""

    def too_big(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 23.6 GiB total)\nmore")

    monkeypatch.setattr(moelane, "load", too_big)
    line = cli_error(["run", "hello"], capsys)
    assert "out of device memory (CUDA out of memory. Tried to allocate 20.00 GiB" in line and "--expert-memory" in line


def raises_only_at_the_host_copy(lm: LM, rows: list[Rows]) -> None:
    """`lm.forward(rows)` on the meta device runs through (every tensor it makes is there: a tensor made on the CPU
    would meet a meta one and fail) and stops only where the logits are copied to the host, which meta tensors cannot
    be (they hold no data)."""
    with pytest.raises(NotImplementedError, match="meta") as e:
        lm.forward(rows)
    assert e.traceback[-1].name == "_forward_eager", e.traceback[-1]


FAMILY_NAMES = sorted(f for f in FAMILIES if f != "llama4_text")  # (llama4_text: Llama 4's text model, one family)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_pass_on_another_device_makes_nothing_on_the_cpu(family: str, tmp_path: Path) -> None:
    """The meta device stands in for a GPU: each family's passes (two streams of two cache capacities, a decode round
    of two streams of one pool, and two streams of one pool feeding different row counts) make every tensor where the
    model is."""
    lm = load_folder(random_model(family, tmp_path), device=torch.device("meta"))
    assert lm.device.type == "meta"
    a, b, c = lm.new_cache(256), lm.new_cache(512), lm.new_cache(256)
    raises_only_at_the_host_copy(lm, [Rows(a, [1, 2, 3], 0), Rows(b, [4, 5], 0), Rows(c, [6], 0)])
    raises_only_at_the_host_copy(lm, [Rows(a, [7], 3, decode=True), Rows(c, [8], 1, decode=True)])
    raises_only_at_the_host_copy(lm, [Rows(a, [9, 10], 4), Rows(c, [11], 2)])


@pytest.mark.parametrize(
    "family",
    FAMILY_NAMES,
)
def test_the_compiled_step_on_another_device_makes_nothing_on_the_cpu(family: str, tmp_path: Path) -> None:
    """The compiled decode step, traced whole (Dynamo, fullgraph; run by its eager backend, since Inductor has no code
    for the meta device), on the meta device: rows of two pools in one call make every tensor where the model is."""
    lm = load_folder(random_model(family, tmp_path), device=torch.device("meta"))
    step = types.FunctionType(LM._decode_step.__code__.replace(), LM._decode_step.__globals__, "_decode_step")
    lm._compiled = torch.compile(types.MethodType(step, lm), backend="eager", fullgraph=True, dynamic=False)
    a, b = lm.new_cache(256), lm.new_cache(512)
    rows = [Rows(a, [7], 3, decode=True), Rows(b, [8], 1, decode=True), Rows(b, [9], 2, decode=True)]
    with pytest.raises(NotImplementedError, match="meta") as e:
        lm.forward(rows)
    assert e.traceback[-1].name == "_decode", e.traceback[-1]  # (the logits' copy to the host, after the step)
