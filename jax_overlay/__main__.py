import argparse
import sys

from . import doctor


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_overlay")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="versions, devices and a live round trip on each path")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    if args.command == "doctor":
        return doctor.run(as_json=args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
