"""Random number generation of ``torch.openreg``.

Each device has a default generator (csrc/adapters/generator.cpp); random operators on openreg
tensors draw from it, so seeding and saving the state here reproduces their results.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from torch_openreg import _C


def _index(device: Any) -> int:
    from . import _device_index

    return _device_index(device)



def _make_default_generators() -> tuple[torch.Generator, ...]:
    return tuple(_C._default_generator(i) for i in range(_C._device_count()))


default_generators: tuple[torch.Generator, ...] = _make_default_generators()


def get_rng_state(device: Any = "openreg") -> torch.Tensor:
    """State of the device's default generator, as a CPU ByteTensor."""
    return default_generators[_index(device)].get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in default_generators]


def set_rng_state(new_state: torch.Tensor, device: Any = "openreg") -> None:
    default_generators[_index(device)].set_state(new_state.clone(memory_format=torch.contiguous_format).cpu())


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seeds the default generator of the current device."""
    default_generators[_index(None)].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds the default generators of all devices."""
    for g in default_generators:
        g.manual_seed(int(seed))


def seed() -> None:
    """Seeds the current device's generator with a non-deterministic random number."""
    default_generators[_index(None)].seed()


def seed_all() -> None:
    """Seeds every device's generator with one non-deterministic random number."""
    s = default_generators[0].seed()
    for g in default_generators[1:]:
        g.manual_seed(s)


def initial_seed() -> int:
    """The seed of the current device's default generator."""
    return default_generators[_index(None)].initial_seed()


def get_offset(device: Any = "openreg") -> int:
    raise RuntimeError("openreg generators are not counter-based: get_offset is not supported")


def set_offset(offset: int, device: Any = "openreg") -> None:
    raise RuntimeError("openreg generators are not counter-based: set_offset is not supported")
