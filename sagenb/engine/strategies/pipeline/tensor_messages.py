"""Messages between ranks made of tensors only: nothing received is unpickled.

torch.distributed's send/recv/broadcast_object_list pickle the object on one side and unpickle
whatever arrives on the other (the warning in their docs,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.send_object_list): anything
that can reach a rank's socket could run code there. What the pipeline exchanges is tensors and
short lists of ints, so it is sent as tensors: an int64 length, an int64 header (what follows:
dtypes and shapes), then the tensors themselves, received into tensors allocated from the
header. A malformed header raises ValueError; it cannot do more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["send_tensors", "recv_tensors", "broadcast_ints_or_error"]

#: the dtypes a message may carry, by their position here (the same table on every rank)
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
#: what holds the tensors, by position: 0 a tensor alone
CONTAINERS: tuple[type, ...] = (torch.Tensor, tuple, list)
MAX_HEADER = 1 << 16  # int64s: far above any stage output's (2 + n x (2 + ndim))


def send_tensors(value: torch.Tensor | tuple | list, dst: int, device: torch.device) -> None:
    """Send a tensor, or a tuple or list of tensors, to rank `dst` (recv_tensors receives it)."""
    parts = value if isinstance(value, (tuple, list)) else (value,)
    kind = 2 if isinstance(value, list) else int(isinstance(value, tuple))  # CONTAINERS
    header = [kind, len(parts)]
    for part in parts:
        if not torch.is_tensor(part) or part.dtype not in DTYPES:
            what = part.dtype if torch.is_tensor(part) else type(part).__name__
            raise TypeError(f"a pipeline stage sends tensors of {DTYPES} only, not {what}")
        header += [DTYPES.index(part.dtype), part.dim(), *part.shape]
    _send_ints(header, dst, device)
    for part in parts:
        dist.send(_wire(part).to(device).contiguous(), dst=dst)


def recv_tensors(src: int, device: torch.device) -> torch.Tensor | tuple | list:
    """What send_tensors sent from rank `src`, on `device`."""
    header = _recv_ints(src, device)
    kind, n, rest = header[0], header[1], header[2:]
    if not 0 <= kind < len(CONTAINERS) or not (n == 1 or kind):
        raise ValueError(f"a malformed tensor message from rank {src}")
    parts = []
    for _ in range(n):
        if len(rest) < 2 or not 0 <= rest[0] < len(DTYPES) or len(rest) < 2 + rest[1]:
            raise ValueError(f"a malformed tensor message from rank {src}")
        dtype, ndim = DTYPES[rest[0]], rest[1]
        shape, rest = rest[2 : 2 + ndim], rest[2 + ndim :]
        buffer = torch.empty(shape, dtype=_wire_dtype(dtype), device=device)
        dist.recv(buffer, src=src)
        parts.append(buffer.to(dtype))
    return CONTAINERS[kind](parts) if kind else parts[0]


def broadcast_ints_or_error(
    value: list[int] | Exception | None, src: int, device: torch.device
) -> list[int] | str:
    """Rank `src`'s list of ints on every rank; or, when `src` has an exception, its message
    (UTF-8 bytes, as ints) for the receivers to raise in their turn: returned as a str."""
    if dist.get_rank() == src:
        error = isinstance(value, Exception)
        payload = list(str(value).encode()) if isinstance(value, Exception) else list(value or [])
        header = torch.tensor([int(error), len(payload)], dtype=torch.int64, device=device)
    else:
        header = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src)
    is_error, n = (int(v) for v in header.tolist())
    data = (
        torch.tensor(payload, dtype=torch.int64, device=device)
        if dist.get_rank() == src
        else torch.zeros(n, dtype=torch.int64, device=device)
    )
    if n:
        dist.broadcast(data, src=src)
    values = data.tolist()
    return bytes(values).decode(errors="replace") if is_error else values


def _send_ints(values: list[int], dst: int, device: torch.device) -> None:
    dist.send(torch.tensor([len(values)], dtype=torch.int64, device=device), dst=dst)
    dist.send(torch.tensor(values, dtype=torch.int64, device=device), dst=dst)


def _recv_ints(src: int, device: torch.device) -> list[int]:
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src)
    n = int(length)
    if not 2 <= n <= MAX_HEADER:
        raise ValueError(f"a malformed tensor message from rank {src} (header of {n})")
    values = torch.zeros(n, dtype=torch.int64, device=device)
    dist.recv(values, src=src)
    return values.tolist()


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # bool travels as bytes


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(_wire_dtype(tensor.dtype))
