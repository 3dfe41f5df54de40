"""What one exchange carries, as bytes: the header every rank reads, a rank's request (its pairs' rows and experts),
and its reply (their outputs, or the error that stopped it).

Shape alphabet: W ranks, U rows a rank receives (each token's row once, however many of its experts the rank
holds), P pairs a rank computes, H hidden, I expert width.

    header   int64 [4 + 2W]: op, layer, n_tokens, has_bias, then (U, P) of each rank
    request  rows_of int32 [P] | local expert ids int32 [P] | rows [U, H] | (b13 [P, 2I] | b2 [P, H] with bias)
    reply    status int64 [1] | outputs [P, H]; or status 1 and the error's text, cut to the reply's length

Integers come first, so every part starts at a multiple of its element size (a byte tensor's slices are viewed as
their dtypes, not copied).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moelane.model.experts import PairBias

STOP, LAYER, STATS = 0, 1, 2  # header ops (STATS: every rank sends its counters to rank 0, `counters.py`)
HEAD = 4  # header fields before the per-rank counts
OK, FAILED = 0, 1  # reply status


class Request(NamedTuple):
    rows: torch.Tensor  # [U, H]
    rows_of: torch.Tensor  # [P]: each pair's row
    ids: torch.Tensor  # [P]: each pair's expert, local to its rank
    bias: PairBias | None


def header(op: int, world: int, layer: int = 0, n_tokens: int = 0, has_bias: bool = False,
           counts: list[tuple[int, int]] | None = None) -> torch.Tensor:  # fmt: skip
    out = torch.zeros(HEAD + 2 * world, dtype=torch.int64)
    out[:HEAD] = torch.tensor([op, layer, n_tokens, int(has_bias)])
    if counts is not None:
        out[HEAD:] = torch.tensor(counts, dtype=torch.int64).reshape(-1)
    return out


def request_bytes(n_rows: int, n_pairs: int, hidden: int, width: int, dtype: torch.dtype, has_bias: bool) -> int:
    size = dtype.itemsize
    return 8 * n_pairs + size * (n_rows * hidden + (n_pairs * (2 * width + hidden) if has_bias else 0))


def pack_request(request: Request) -> torch.Tensor:
    parts = [request.rows_of.to(torch.int32), request.ids.to(torch.int32), request.rows]
    if request.bias is not None:
        parts += [request.bias.b13, request.bias.b2]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])


def unpack_request(blob: torch.Tensor, n_rows: int, n_pairs: int, hidden: int, width: int, dtype: torch.dtype,
                   has_bias: bool) -> Request:  # fmt: skip
    shapes: list[tuple[torch.dtype, tuple[int, ...]]] = [
        (torch.int32, (n_pairs,)), (torch.int32, (n_pairs,)), (dtype, (n_rows, hidden))
    ]  # fmt: skip
    if has_bias:
        shapes += [(dtype, (n_pairs, 2 * width)), (dtype, (n_pairs, hidden))]
    parts, at = [], 0
    for part_dtype, shape in shapes:
        n = part_dtype.itemsize * _count(shape)
        parts.append(blob[at : at + n].view(part_dtype).view(shape))
        at += n
    assert at == blob.numel(), "a request's length disagrees with its header"
    bias = PairBias(parts[3], parts[4]) if has_bias else None
    return Request(parts[2], parts[0].long(), parts[1].long(), bias)


def reply_bytes(n_pairs: int, hidden: int, dtype: torch.dtype) -> int:
    return 8 + n_pairs * hidden * dtype.itemsize


def pack_reply(outputs: torch.Tensor) -> torch.Tensor:
    status = torch.tensor([OK], dtype=torch.int64).view(torch.uint8)
    return torch.cat([status, outputs.contiguous().view(torch.uint8).reshape(-1)])


def pack_failure(message: str, n_bytes: int) -> torch.Tensor:
    """A reply of `n_bytes` that says the rank failed, with as much of `message` as fits."""
    out = torch.zeros(n_bytes, dtype=torch.uint8)
    out[:8] = torch.tensor([FAILED], dtype=torch.int64).view(torch.uint8)
    text = message.encode("utf-8", "replace")[: n_bytes - 8]
    out[8 : 8 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out


def unpack_reply(blob: torch.Tensor, n_pairs: int, hidden: int, dtype: torch.dtype) -> torch.Tensor | str:
    """The outputs [P, H], or the failed rank's error text."""
    if int(blob[:8].clone().view(torch.int64)[0]) != OK:  # (a copy: a reply need not start 8-byte aligned)
        return bytes(blob[8:].tolist()).rstrip(b"\0").decode("utf-8", "replace") or "(no message)"
    return blob[8:].view(dtype).view(n_pairs, hidden)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
