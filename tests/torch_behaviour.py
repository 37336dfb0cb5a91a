"""What the tests expect of torch where torch itself behaves differently between the supported
releases (2.13 to 2.15): one entry per difference, named after what differs, with the releases.
openreg behaves as the installed torch asks in each case; only the expectation moves.
The package's own differences live with their mechanism (docs/torch_releases.md lists both)."""
import torch

from torch_openreg import _native_build

RELEASE = _native_build.release(torch.__version__)

# From torch 2.14 on, the default backend of a group made with `device_id` and a backend string of
# several devices ("cpu:gloo,openreg:occl") is the device's backend (occl: "custom"), so that
# barrier() runs on the device; 2.13 leaves it unnamed ("undefined").
MIXED_GROUP_DEFAULT_BACKEND_WITH_DEVICE_ID = "custom" if RELEASE >= (2, 14) else "undefined"

# dist.split_group gives the ranks left out of every split no group: None in torch 2.13,
# GroupMember.NON_GROUP_MEMBER from 2.14 on.
NOT_IN_SPLIT = (torch.distributed.GroupMember.NON_GROUP_MEMBER if RELEASE >= (2, 14) else None)

# torch.accelerator.random (initial_seed, get_rng_state, get_rng_state_all) is new in torch 2.14.
HAS_ACCELERATOR_RANDOM = RELEASE >= (2, 14)

# Where a group that leaves ranks out (new_group([0, 1]) of 4, made by perform_nocolor_split on a
# device-bound group) may come among dist.split_group calls without gloo's peers missing each
# other in the store: torch 2.13 names split groups after their ranks and the number of groups
# the rank knows, so such a group must come after the splits; from 2.14 on, a split made after
# ranks were left out of another split must come after it instead (both orders hang until the
# timeout on the other releases; measured on 2.13 and 2.15, 2026-11-28).
PARTIAL_GROUP_BEFORE_SPLITS = RELEASE >= (2, 14)

# PyTorch's device test bases leave out single dtypes of a method given in
# set_test_configs(test_exclusions={cls: {method: {"dtypes": [...]}}}) from torch 2.14 on; 2.13
# reads only whether the method is named, so it leaves out the whole method.
DTYPE_EXCLUSIONS = RELEASE >= (2, 14)

# The derivative of native_group_norm hands native_group_norm_backward the gradient and the input
# in the input's layout on every device from torch 2.14 on; 2.13 makes both contiguous on every
# device but the CPU, so on a channels-last input the backward kernel reduces in another order
# there and openreg's gradients differ from the CPU's in the last bits (strides equal; measured
# on 2.13.0, 2.14.1 and 2.15.0, 2026-11-28).
GROUP_NORM_BACKWARD_KEEPS_CHANNELS_LAST = RELEASE >= (2, 14)

# PYTORCH_TESTING_DEVICE_FOR_CUSTOM lets a file whose tests are only for CUDA (only_for="cuda") run
# on a custom device from torch 2.15 on; before, the variable is compared with the test base's
# device type, "privateuse1" before the first test class is set up, so the backend's name never
# matches (tests/test_privateuse1_gaps.py).
DEVICE_FOR_CUSTOM_MATCHES_BACKEND_NAME = RELEASE >= (2, 15)
