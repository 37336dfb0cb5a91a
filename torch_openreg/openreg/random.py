"""Random number generation of ``torch.openreg``.

Each device has a default generator (csrc/adapters/generator.cpp); random operators on openreg
tensors draw from it, so seeding and saving the state here reproduces their results. The
functions follow ``torch.cuda``'s (``torch.cuda.random``); ``torch.manual_seed``/``torch.seed``
reach ``manual_seed_all`` here, and ``torch.random.fork_rng(device_type="openreg")`` uses
``get_rng_state``/``set_rng_state``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from torch_openreg import _C


def _make_default_generators() -> tuple[torch.Generator, ...]:
    return tuple(_C._default_generator(i) for i in range(_C._device_count()))


# [docs:start DEFAULT_GENERATORS_PY]
# The Python objects of the devices' default generators, the ones the PrivateUse1 hook
# getDefaultGenerator returns to ATen (torch.openreg.default_generators[i]).
default_generators: tuple[torch.Generator, ...] = _make_default_generators()


def _get_generator(device: Any = "openreg") -> torch.Generator:
    """The default generator of ``device`` (int, str, torch.device; None = current device)."""
    from . import _device_index

    index = _device_index(device)
    if not 0 <= index < len(default_generators):
        count = len(default_generators)
        # The error type of an invalid device index everywhere (native check_device, CUDA).
        raise torch.AcceleratorError(
            f"openreg device index is out of range: got {index}, but there "
            f"{'is 1 device' if count == 1 else f'are {count} devices'} "
            "(set OPENREG_DEVICE_COUNT to change it)"
        )
    return default_generators[index]
# [docs:end DEFAULT_GENERATORS_PY]


def get_rng_state(device: Any = "openreg") -> torch.Tensor:
    """State of the device's default generator, as a CPU ByteTensor (a copy)."""
    return _get_generator(device).get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    """States of all devices' default generators."""
    return [g.get_state() for g in default_generators]


def set_rng_state(new_state: torch.Tensor, device: Any = "openreg") -> None:
    """Restores the device's default generator from a state returned by ``get_rng_state``.

    ``new_state`` must be a CPU ByteTensor of the right size (TypeError / RuntimeError otherwise,
    as with ``torch.cuda.set_rng_state``).
    """
    gen = _get_generator(device)
    if isinstance(new_state, torch.Tensor):
        new_state = new_state.contiguous()
    gen.set_state(new_state)


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    """Restores every device's default generator; ``new_states[i]`` is device i's state."""
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seeds the default generator of the current device."""
    _get_generator(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds the default generators of all devices (``torch.manual_seed`` calls this)."""
    seed = int(seed)
    for g in default_generators:
        g.manual_seed(seed)


def seed() -> None:
    """Seeds the current device's generator with a non-deterministic random number."""
    _get_generator(None).seed()


def seed_all() -> None:
    """Seeds every device's generator with one non-deterministic random number."""
    if not default_generators:
        return
    s = default_generators[0].seed()
    for g in default_generators[1:]:
        g.manual_seed(s)


def initial_seed() -> int:
    """The seed of the current device's default generator."""
    return _get_generator(None).initial_seed()


def get_offset(device: Any = "openreg") -> int:
    """Not supported: openreg generators are mt19937 engines, not (seed, offset) counters.

    Raises the generator's RuntimeError; use ``get_rng_state`` instead.
    """
    return _get_generator(device).get_offset()


def set_offset(offset: int, device: Any = "openreg") -> None:
    """Not supported (see ``get_offset``); use ``set_rng_state`` instead."""
    _get_generator(device).set_offset(int(offset))


# [docs:start GRAPHSAFE_RNG]
def _register_graphsafe_rng() -> None:
    """Declares to torch.compile that openreg generators support graph-safe state.

    The generators implement graphsafe_get_state/graphsafe_set_state/clone_state (shared, not
    copied, state objects), so AOTAutograd can replay a random operator on a saved generator state
    (the ``graphsafe_run_with_rng_state`` higher-order operator) through ``_get_generator`` and
    ``get_rng_state`` above.
    """
    from torch._functorch._aot_autograd.utils import register_graphsafe_rng_device_type

    register_graphsafe_rng_device_type("openreg")
# [docs:end GRAPHSAFE_RNG]
