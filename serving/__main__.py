"""``python -m serving <subcommand>``: ``adp`` (ADP balance) and ``plan`` (the PD planner).

Bad input gives one ``error:`` line on stderr and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line ``error:`` message (no usage dump) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def _prog() -> str:
    arg0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    if arg0.startswith("moe-ep"):
        return arg0
    return f"python -m {__package__ or 'serving'}"   # serving in the checkout, moe_ep_serving installed


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog=_prog(), description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"serving (moe-ep) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{adp,plan}")
    sub.required = True
    from .adp import add_adp_parser
    add_adp_parser(sub)
    try:
        from .cli_plan import add_plan_parser
    except ImportError:
        pass
    else:
        add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .sim import SimError
    from .trace import TraceError
    try:
        return int(args.func(args) or 0)
    except (TraceError, SimError, ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        sys.stderr.write(f"error: {msg}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
