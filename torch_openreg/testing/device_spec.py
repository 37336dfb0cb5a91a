"""The device spec of openreg for the test suites of transformers and diffusers
(docs/test_suites.md).

Both suites read the module named by ``TRANSFORMERS_TEST_DEVICE_SPEC`` / ``DIFFUSERS_TEST_DEVICE_SPEC``
and take from it the device name and the functions their device-agnostic helpers
(``backend_manual_seed``, ``backend_empty_cache``, ``backend_device_count``, ...) call for that
device. They import it by file name from the folder the tests run from: write the file that
imports this module with ``python -m torch_openreg.testing spec transformers``.
"""
import torch

import torch_openreg  # noqa: F401  (the suite may run with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

if not torch.openreg.is_available():
    raise RuntimeError(
        "openreg's device spec was imported (TRANSFORMERS_TEST_DEVICE_SPEC or "
        "DIFFUSERS_TEST_DEVICE_SPEC), but openreg has no device: OPENREG_DEVICE_COUNT="
        f"{torch.openreg.device_count()}. Fix: unset OPENREG_DEVICE_COUNT or set it to 1 or more")

# [docs:start DEVICE_SPEC]
DEVICE_NAME = "openreg"
# Read by transformers and diffusers:
MANUAL_SEED_FN = torch.openreg.manual_seed
EMPTY_CACHE_FN = torch.openreg.empty_cache
DEVICE_COUNT_FN = torch.openreg.device_count
# Read by diffusers only:
SUPPORTS_TRAINING = True
RESET_PEAK_MEMORY_STATS_FN = torch.openreg.reset_peak_memory_stats
RESET_MAX_MEMORY_ALLOCATED_FN = torch.openreg.reset_peak_memory_stats
MAX_MEMORY_ALLOCATED_FN = torch.openreg.max_memory_allocated
# [docs:end DEVICE_SPEC]
