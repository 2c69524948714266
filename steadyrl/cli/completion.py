"""`steadyrl completion {bash,zsh,tcsh}`: the shell completion script of the real parser (every
command, option and choice `build_parser` has), written by the `shtab` library.

The script is built from the parser itself, so it never lags behind a new command: add_parsers
is given the whole parser (steadyrl.cli.build_parser calls it last, after every command is in).
"""

from __future__ import annotations

import argparse

#: The shells shtab writes a script for.
SHELLS = ("bash", "zsh", "tcsh")


def cmd_completion(args: argparse.Namespace) -> int:
    """Print the completion script for `args.shell` on stdout."""
    import shtab  # lazy: only this command writes completion scripts

    print(shtab.complete(args.root_parser, shell=args.shell), end="")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser], root: argparse.ArgumentParser) -> None:
    sp = sub.add_parser("completion", help="the shell completion script (bash, zsh or tcsh) on stdout",
                        description="Print the completion script of every steadyrl command for a shell. bash: "
                                    "`steadyrl completion bash > ~/.local/share/bash-completion/completions/"
                                    "steadyrl`; zsh: `steadyrl completion zsh > ~/.zfunc/_steadyrl` (with "
                                    "`fpath+=~/.zfunc` before `compinit` in ~/.zshrc).")
    sp.add_argument("shell", choices=SHELLS)
    sp.set_defaults(fn=cmd_completion, root_parser=root)
