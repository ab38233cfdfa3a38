"""Command line: ``python -m moe_ep demo [options]`` (``--help`` lists them)."""

import sys

from . import __version__
from ._env import prog, write_stdout


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = prog("moe_ep")
    if argv and argv[0] == "--version":
        return write_stdout(f"moe-ep {__version__}")
    if not argv or argv[0] in ("-h", "--help"):
        rc = write_stdout(f"usage: {name} [--version] demo [options]\n\n"
                          "  demo   run a DeepSeek-V3-shaped MoE layer over N local ranks and check it against a "
                          f"dense computation\n\nRun `{name} demo --help` for the options.")
        return rc or (0 if argv else 2)
    if argv[0] == "demo":
        from .demo import main as demo_main
        return demo_main(argv[1:], prog=f"{name} demo")
    print(f"unknown command {argv[0]!r}; try `{name} demo --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
