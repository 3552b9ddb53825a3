"""Room: `python -m jax_overlay`: the doctor's command line."""

import argparse
import sys

from . import doctor


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_overlay")
    sub = p.add_subparsers(dest="command", required=True)
    doctor.add_arguments(sub.add_parser(
        "doctor", help="versions, devices, and a live round trip on every path, stock JAX vs jax_overlay",
        description=doctor.description()))
    args = p.parse_args(argv)
    if args.command == "doctor":
        return doctor.run(as_json=args.json, plain=args.plain, trials=args.trials, calls=args.calls,
                          json_file=args.json_file)
    return 2


if __name__ == "__main__":
    sys.exit(main())
