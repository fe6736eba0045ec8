"""Nested cache states (tensors inside dicts, lists, tuples, dataclasses): find them, move them.

Checkpoints, segments and shared prefixes all hold such trees, one entry per layer kind.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `value`, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from tensors_in(getattr(value, name))


def moved(value: Any, device: torch.device | str) -> Any:
    """The same nested structure with every tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: moved(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(item, device) for item in value)
    if hasattr(value, "__dataclass_fields__"):
        return type(value)(**{name: moved(getattr(value, name), device) for name in value.__dataclass_fields__})
    return value


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (crops and slices are views)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def filled_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors themselves: the states a session holds, without the room its buffers
    keep to grow (what a copy of them, e.g. a cold-tier file, takes)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
