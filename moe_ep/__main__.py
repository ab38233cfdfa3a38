"""Command line: ``python -m moe_ep demo [options]`` (``--help`` lists them)."""

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m moe_ep demo [options]\n\n"
              "  demo   run a DeepSeek-V3-shaped MoE layer over N local ranks and check it against a dense "
              "computation\n\nRun `python -m moe_ep demo --help` for the options.")
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo_main
        return demo_main(argv[1:])
    print(f"unknown command {argv[0]!r}; try `python -m moe_ep demo --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
