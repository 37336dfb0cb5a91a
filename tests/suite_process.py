"""A Python process that runs a test suite as its users run it, for the tests of docs/test_suites.md
and docs/privateuse1_gaps.md: none of the suites' own variables inherited from this process,
offline (no model hub), and without `CI`.

Without CI: under CI (any value) PyTorch's run_tests() writes JUnit XML through xmlrunner instead
of the -v lines these tests read (docs/test_suites.md says so to users).
"""
import os
import subprocess
import sys

# The variables through which each suite is pointed at a device (docs/test_suites.md).
SUITE_VARIABLES = ("TRANSFORMERS_", "DIFFUSERS_", "TORCH_TEST_DEVICES", "PYTORCH_TESTING")


def run(args, cwd, env_extra=None, timeout=300):
    """`python *args` in cwd, with this process's environment minus the suites' variables and CI,
    plus env_extra; returns the CompletedProcess (text output captured)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SUITE_VARIABLES) and k != "CI"}
    env.update(HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)
