"""``python -m torch_openreg.testing spec SUITE``: what a test suite needs to run on openreg
(docs/test_suites.md).

- ``spec pytorch`` prints the path of the test base for ``TORCH_TEST_DEVICES``;
- ``spec transformers`` / ``spec diffusers`` writes ``openreg_device_spec.py`` into the current
  folder (or ``--dir``) and prints the value for ``TRANSFORMERS_TEST_DEVICE_SPEC`` /
  ``DIFFUSERS_TEST_DEVICE_SPEC``: the bare file name, which is all these suites can import;
- ``exclusions`` prints the tests of PyTorch's suite the test base leaves out, with the reasons.

Only the value goes to stdout, so that ``export VAR=$(python -m torch_openreg.testing spec ...)``
works; what was done goes to stderr.
"""
import argparse
import sys

from torch_openreg import testing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_openreg.testing")
    sub = parser.add_subparsers(dest="command", required=True)
    spec = sub.add_parser("spec", help="print (and write) what a test suite needs")
    spec.add_argument("suite", choices=["pytorch", *testing.SPEC_VARIABLES])
    spec.add_argument("--dir", default=".", help="folder to write the spec to (default: .)")
    sub.add_parser("exclusions", help="the tests of PyTorch's suite left out, with the reasons")
    args = parser.parse_args(argv)
    if args.command == "exclusions":
        for cls, methods in testing.TEST_EXCLUSIONS.items():
            for method, reason in methods.items():
                dtypes = testing.TEST_EXCLUSION_DTYPES.get(cls, {}).get(method)
                only = f" [{', '.join(str(d) for d in dtypes)}]" if dtypes else ""
                print(f"{cls}.{method}{only}: {reason}")
        return 0
    if args.suite == "pytorch":
        print(testing.spec_value("pytorch"))
        print("set TORCH_TEST_DEVICES to this path, and PYTORCH_TESTING_DEVICE_ONLY_FOR=openreg "
              "to leave out the CPU", file=sys.stderr)
        return 0
    path = testing.write_spec(args.suite, args.dir)
    var = testing.SPEC_VARIABLES[args.suite]
    print(testing.spec_value(args.suite))
    print(f"wrote {path}; set {var}_TEST_DEVICE_SPEC={testing.SPEC_FILE} and run the tests from "
          f"{path.parent.resolve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
