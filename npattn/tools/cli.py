"""The ``npattn`` command (also ``python -m npattn``): ``demo``, ``explain``, ``gpt``, ``info``,
``warmup``.

Each subcommand owns its options: ``npattn <command> ...`` hands everything after the command
name to that command's own ``main(argv, prog)``, imported only when it runs (so ``npattn info``
never imports the demo, and ``npattn --help`` compiles nothing).
"""
import argparse
import importlib
import inspect
import os
import sys

from .. import __version__
from .progress import compile_progress

#: command -> (module, one-line help); each module has ``main(argv=None) -> int`` (and may take
#: ``prog=``, the name its usage line shows).
COMMANDS = {
    "demo": ("npattn.tools.demo",
             "the main job: train a small attention model to reverse digits "
             "(npattn demo --help for its options)"),
    "explain": ("npattn.tools.explain",
                "the seed article's dot-product attention, step by step: formulas, shapes and "
                "numbers from npattn's kernels, checked against the float64 reference"),
    "gpt": ("npattn.tools.gpt",
            "a character-level GPT: 'gpt train' on a text (Python's own docs by default), "
            "'gpt sample' from the checkpoint"),
    "info": ("npattn.tools.info",
             "what npattn runs on: versions, Numba's threading layer and settings, the kernel "
             "cache directory, CPU SIMD features"),
    "warmup": ("npattn.tools.warmup",
               "compile every kernel into Numba's disk cache ahead of time "
               "(container images, CI caches)"),
}

#: Commands that report their own compiling (warmup: per step, from several processes).
QUIET_COMPILES = {"warmup"}


def _prog():
    """"python -m npattn" when run as a module, else the script's name (normally "npattn")."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "npattn"
    return "python -m npattn" if name == "__main__.py" else name if name != "-c" else "npattn"


def build_parser(prog="npattn"):
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="npattn: a from-scratch attention engine on NumPy and Numba.",
        epilog="examples:\n"
               f"  {prog} demo                      train the demo model\n"
               f"  {prog} explain --dtype float64   the article's walkthrough in float64\n"
               f"  {prog} gpt train                 train a character-level GPT\n"
               f"  {prog} info                      versions, threads, cache, CPU\n"
               f"  {prog} <command> --help          a command's own options")
    parser.add_argument("--version", action="version", version=f"npattn {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="<command>")
    for name, (_, help_text) in COMMANDS.items():
        # add_help=False: "npattn explain --help" is the command's own help, not this stub's
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv=None):
    """Run ``npattn <command> [options]``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = _prog()
    parser = build_parser(prog)
    if not argv:
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv)           # exits on --help, --version, a typo
    if args.command is None:                             # options but no command
        parser.error(f"a command is required: one of {', '.join(COMMANDS)}; got {argv}")
    module_name, _ = COMMANDS[args.command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"{prog} {args.command}: not available in this installation ({module_name} is "
              "missing)", file=sys.stderr)
        return 2
    kwargs = ({"prog": f"{prog} {args.command}"}
              if "prog" in inspect.signature(module.main).parameters else {})
    if args.command in QUIET_COMPILES:
        return module.main(rest, **kwargs)
    with compile_progress():                             # a cold run says what it compiles
        return module.main(rest, **kwargs)
