"""gather_linear on both implementations (`impl`: the extension, then the forced fallback): every kind against a
float64 reference, batch invariance (a pair alone against the same pair among 2..16 others, its slot repeated or
not, at 1 and 2 threads), odd sizes, `linear`, and errors at the edge."""

from __future__ import annotations

import threading

import pytest
import torch

from moelane import kernels
from moelane.kernels import fallback, formats, op
from tests.kernels.helpers import random_pool, reference

# (In, Out): int8 groups of 64 / 32 / 16 / 64 padded (36, 100), int4 32 / 16 with a tail (48) / padded; f32 and bf16
# with a masked last chunk (36, 100, 17)
SIZES = [(192, 9), (96, 5), (36, 3), (48, 1), (100, 4), (17, 6), (2048, 2)]


def pairs(n: int, n_rows: int, n_slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_rows, (n,), generator=g), torch.randint(0, n_slots, (n,), generator=g)


@pytest.mark.parametrize("kind", kernels.KINDS)
@pytest.mark.parametrize(("n_in", "n_out"), SIZES)
def test_matches_float64_reference(impl: str, kind: str, n_in: int, n_out: int) -> None:
    pool = random_pool(kind, 3, n_out, n_in, seed=n_in * 10 + n_out)
    x = torch.randn(4, n_in, generator=torch.Generator().manual_seed(1))
    rows, slots = pairs(11, 4, 3, seed=2)
    y = kernels.gather_linear(x, rows, slots, pool)
    want, bound = reference(x, rows, slots, pool)
    assert y.dtype == torch.float32 and y.shape == (11, n_out)
    assert torch.all((y.double() - want).abs() <= bound), (y.double() - want).abs().max()


@pytest.mark.parametrize("kind", kernels.KINDS)
@pytest.mark.parametrize("n_in", [192, 48])
def test_pair_bits_do_not_depend_on_the_call(impl: str, kind: str, n_in: int, threads: None) -> None:
    """Pair (row 3, slot 2) alone, then among 2..16 pairs of other rows and slots interleaved, of its own slot
    repeated, with x holding its row at another index, at 2 and at 1 thread: always the same bits."""
    n_slots, n_out = 6, 37  # 37: a tail group of output rows
    pool = random_pool(kind, n_slots, n_out, n_in, seed=7)
    x = torch.randn(16, n_in, generator=torch.Generator().manual_seed(8))
    torch.set_num_threads(2)
    alone = kernels.gather_linear(x[3:4], torch.tensor([0]), torch.tensor([2]), pool)[0]
    for n_threads in (2, 1):
        torch.set_num_threads(n_threads)
        for n in range(2, 17):
            rows, slots = pairs(n, 16, n_slots, seed=n)
            at = n // 2
            rows[at], slots[at] = 3, 2
            y = kernels.gather_linear(x, rows, slots, pool)
            assert torch.equal(y[at], alone), (n_threads, n, "mixed slots")
            same = kernels.gather_linear(x, rows, torch.full_like(slots, 2), pool)
            assert torch.equal(same[at], alone), (n_threads, n, "one slot")
            moved = torch.roll(x, 5, dims=0)  # row 3 is now row 8
            y = kernels.gather_linear(moved, (rows + 5) % 16, slots, pool)
            assert torch.equal(y[at], alone), (n_threads, n, "x rows moved")


def test_bits_hold_when_threads_take_each_others_items(extension: kernels.Availability, threads: None) -> None:
    """The extension's threads take over the items of a slowed thread's share (gather_linear.cpp). With 6 threads on
    this machine's cores, a busy Python thread beside them, threads are descheduled mid-call and items change hands:
    every call still gives the 1-thread bits."""
    pool = random_pool("int4", 4, 512, 256, seed=11)  # 512 output rows of 256: several items a slot
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(12))
    rows, slots = pairs(12, 8, 4, seed=13)
    torch.set_num_threads(1)
    want = kernels.gather_linear(x, rows, slots, pool)
    torch.set_num_threads(6)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(2000))

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    try:
        for _ in range(60):
            assert torch.equal(kernels.gather_linear(x, rows, slots, pool), want)
    finally:
        stop.set()
        busy.join()


def test_extension_reads_bf16_as_its_dequantised_f32(extension: kernels.Availability) -> None:
    """bf16 weights are widened exactly, then the same fp32 dot product as an f32 pool: the same bits."""
    for n_in in (192, 96, 48, 36):
        pool = random_pool("bf16", 2, 9, n_in, seed=n_in)
        as_f32 = kernels.Pool("f32", kernels.dequantize(pool))
        x = torch.randn(5, n_in)
        rows, slots = pairs(7, 5, 2, seed=3)
        assert torch.equal(kernels.gather_linear(x, rows, slots, pool), kernels.gather_linear(x, rows, slots, as_f32))


@pytest.mark.parametrize("n_in", [192, 100, 36, 2048, 7, 45, 95])
def test_extension_codes_activations_as_formats_does(extension: kernels.Availability, n_in: int) -> None:
    """The integer kernels' activation codes and scales (csrc/activations.h) are formats.quantize_activations' bit for
    bit: rows of ties (k + 0.5 steps), an all-zero block, a padded tail (short blocks of 7, 4, 13 and 31 columns),
    tiny and huge magnitudes."""
    g = torch.Generator().manual_seed(n_in)
    x = torch.randn(6, n_in, generator=g)
    x[1] = (torch.randint(-254, 255, (n_in,), generator=g) / 2.0) * 0.25  # halves of the step: ties to even
    x[1, ::32] = 127 * 0.25 / 2  # each block's extreme: d = 0.125, codes exact or ties
    x[2, :32] = 0.0
    x[3] *= 1e-30
    x[5, 32:64] *= 1e-40  # a block whose d is subnormal: coded 0
    x[4] *= 1e30
    codes, scales = op._backend.extension().quantise_rows(x)  # type: ignore[union-attr]
    want_codes, want_scales = formats.quantize_activations(x)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert codes.shape == (6, -(-n_in // 64) * 64) and scales.shape == (6, codes.shape[1] // 32)
    assert torch.all(codes[:, n_in:] == 0) and torch.all(codes[2, :32] == 0)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("impl_name", ["extension", "fallback"])
def test_integer_products_with_a_nan_activation_are_nan(
    impl_name: str, kind: str, extension: kernels.Availability
) -> None:
    """A NaN or an infinity in an activation row makes that row's int8 / int4 products NaN (not finite garbage);
    the other rows are untouched."""
    pool = random_pool(kind, 1, 5, 192, seed=1)
    x = torch.randn(3, 192)
    x[0, 70] = float("nan")
    x[1, 5] = float("inf")
    kernels.use_fallback(impl_name == "fallback")
    try:
        y = kernels.linear(x, pool)
    finally:
        kernels.use_fallback(False)
    assert torch.all(torch.isnan(y[:2])) and torch.all(torch.isfinite(y[2]))


@pytest.mark.parametrize("n_in", [200, 45])
def test_extension_codes_activations_in_the_nibble_order(extension: kernels.Availability, n_in: int) -> None:
    """For int4 the kernel holds each 128-column chunk's codes as its 64 even columns, then its 64 odd ones
    (csrc/activations.h, Layout::Nibbles): formats.quantize_activations' codes and scales, so permuted."""
    x = torch.randn(3, n_in)
    codes, scales = op._backend.extension().quantise_rows(x, nibbles=True)  # type: ignore[union-attr]
    cols = -(-n_in // 128) * 128
    want_codes, want_scales = formats.quantize_activations(torch.nn.functional.pad(x, (0, cols - n_in)))
    perm = torch.cat([torch.arange(c, c + 128).view(64, 2).t().flatten() for c in range(0, cols, 128)])
    assert torch.equal(codes, want_codes[:, perm]) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("kind", kernels.KINDS)
def test_odd_sizes(impl: str, kind: str) -> None:
    """No pairs, one slot, one output row, one activation row."""
    pool = random_pool(kind, 1, 1, 36, seed=5)
    x = torch.randn(1, 36)
    none = torch.zeros(0, dtype=torch.int64)
    assert kernels.gather_linear(x, none, none, pool).shape == (0, 1)
    assert kernels.gather_linear(x[:0], none, none, pool).shape == (0, 1)
    rows = torch.zeros(3, dtype=torch.int64)
    y = kernels.gather_linear(x, rows, rows, pool)
    want, bound = reference(x, rows, rows, pool)
    assert y.shape == (3, 1) and torch.all((y.double() - want).abs() <= bound)
    assert torch.equal(y[0], y[2])


@pytest.mark.parametrize("kind", kernels.KINDS)
def test_linear_is_gather_linear_over_one_slot(impl: str, kind: str) -> None:
    pool = random_pool(kind, 1, 21, 96, seed=6)
    x = torch.randn(2, 3, 96)
    flat = x.reshape(6, 96)
    want = kernels.gather_linear(flat, torch.arange(6), torch.zeros(6, dtype=torch.int64), pool)
    y = kernels.linear(x, pool)
    assert y.shape == (2, 3, 21) and torch.equal(y.reshape(6, 21), want)
    with pytest.raises(ValueError, match="one matrix"):
        kernels.linear(x, random_pool(kind, 2, 21, 96, seed=6))


def test_bad_inputs_are_refused(impl: str) -> None:
    pool = random_pool("int8", 2, 4, 64, seed=1)
    x = torch.randn(3, 64)
    ok = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="float32"):
        kernels.gather_linear(x.bfloat16(), ok, ok, pool)
    with pytest.raises(ValueError, match="64"):
        kernels.gather_linear(torch.randn(3, 65), ok, ok, pool)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gather_linear(x, torch.tensor([0, 3]), ok, pool)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gather_linear(x, ok, torch.tensor([2, 0]), pool)


def test_the_dispatcher_calls_the_extension_from_cpp_and_the_fallback_when_forced(
    extension: kernels.Availability,
) -> None:
    """While the extension serves, the ops' CPU kernels in the dispatcher are its C++ ones (compiled code's calls
    never enter Python), with the extension's bits; forcing the fallback puts op.py's Python kernel back."""
    pool = random_pool("int4", 3, 40, 96, seed=2)
    x = torch.randn(5, 96)
    rows, slots = pairs(9, 5, 3, seed=4)
    module = op._backend.extension()
    assert module is not None

    def cpu_kernel(name: str) -> str:
        table: str = torch._C._dispatch_dump_table(f"moelane::{name}")
        return next(line for line in table.splitlines() if line.startswith("CPU:"))

    assert "gather_linear.cpp" in cpu_kernel("gather_linear") and "gather_linear.cpp" in cpu_kernel("attend_cache")
    y = torch.ops.moelane.gather_linear.default(x, rows, slots, pool.data, pool.scales)
    assert torch.equal(y, module.gather_linear(x, rows, slots, pool.data, pool.scales))
    kernels.use_fallback(True)
    try:
        assert "library.py" in cpu_kernel("gather_linear") and "library.py" in cpu_kernel("attend_cache")
        y = torch.ops.moelane.gather_linear.default(x, rows, slots, pool.data, pool.scales)
        assert torch.equal(y, fallback.gather_linear(x, rows, slots, pool.data, pool.scales))
    finally:
        kernels.use_fallback(False)
    assert "gather_linear.cpp" in cpu_kernel("gather_linear")


def test_the_cpp_kernels_release_the_gil(extension: kernels.Availability) -> None:
    """A Python thread runs while a dispatcher call of the op computes (the store's readers and the server do)."""
    pool = random_pool("f32", 1, 4096, 4096, seed=3)
    x = torch.randn(64, 4096)
    ticks = 0
    done = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        before = ticks
        torch.ops.moelane.gather_linear.default(x, None, None, pool.data, pool.scales)
        during = ticks - before
    finally:
        done.set()
        t.join()
    assert during > 100
