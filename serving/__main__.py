"""``python -m serving <subcommand>``: ``adp`` (ADP balance) and ``plan`` (the PD planner).

Bad input gives one ``error:`` line on stderr and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line ``error:`` message (no usage dump) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m serving", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="{adp,plan}")
    sub.required = True
    from serving.adp import add_adp_parser
    add_adp_parser(sub)
    try:
        from serving.cli_plan import add_plan_parser
    except ImportError:
        pass
    else:
        add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from serving.sim import SimError
    from serving.trace import TraceError
    try:
        return int(args.func(args) or 0)
    except (TraceError, SimError, ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        sys.stderr.write(f"error: {msg}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
