"""A/B runs of code variants on the GPU host, each from its own copy of `minfer/`.

Why a script: `python3 -m minfer` puts the working directory first on sys.path, so a variant
put on PYTHONPATH while the command runs from the repository root imports the repository's
own `minfer/` (two sessions of A/Bs measured main against main that way: docs/BENCHMARKS.md).
Here every variant runs with its own directory as the working directory, and each run first
prints the file its `minfer` came from.

Here (the variants are git refs, optionally with a patch applied; `.ab/` is git-ignored and is
carried to the device):

    python3 scripts/ab_variants.py prepare main=HEAD early=HEAD:early.patch

On the device (rounds interleave the variants, in reversed order every other round, so a
drift of the machine hits all alike; relative paths in the command resolve inside a variant):

    python3 scripts/ab_variants.py run --rounds 2 -- bench offline qwen3-0.6b --num-requests 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = os.path.join(ROOT, ".ab")


def prepare(specs: list[str]) -> None:
    shutil.rmtree(VARIANTS, ignore_errors=True)
    for spec in specs:
        name, _, source = spec.partition("=")
        ref, _, patch = source.partition(":")
        if not name or not ref:
            raise SystemExit(f"ab_variants: {spec!r} is not NAME=REF[:PATCH]")
        target = os.path.join(VARIANTS, name)
        os.makedirs(target)
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", ref, "minfer"], check=True, capture_output=True
        )
        subprocess.run(["tar", "-x", "-C", target], input=archive.stdout, check=True)
        if patch:
            with open(os.path.abspath(patch), "rb") as diff:
                subprocess.run(["patch", "-p1", "-s", "-d", target], stdin=diff, check=True)
        print(f"{name}: {ref}{' + ' + patch if patch else ''}")


def run(rounds: int, command: list[str]) -> int:
    names = sorted(os.listdir(VARIANTS)) if os.path.isdir(VARIANTS) else []
    if not names:
        raise SystemExit("ab_variants: nothing prepared under .ab/ (run `prepare` first)")
    failed = 0
    for round_ in range(rounds):
        # A B, then B A: whatever favours a round's first run (a cold machine) favours each alike
        for name in names if round_ % 2 == 0 else names[::-1]:
            where = os.path.realpath(os.path.join(VARIANTS, name))
            print(f"== round {round_ + 1}, {name}: minfer {' '.join(command)}", flush=True)
            origin = subprocess.run(
                [sys.executable, "-c", "import minfer; print(minfer.__file__)"],
                cwd=where,
                capture_output=True,
                text=True,
            )
            imported = os.path.realpath(origin.stdout.strip()) if origin.returncode == 0 else ""
            print(f"   imports {imported or origin.stderr.strip()}", flush=True)
            if not imported.startswith(where + os.sep):
                raise SystemExit(f"ab_variants: {name} did not import its own minfer; check PYTHONPATH")
            failed |= subprocess.run([sys.executable, "-m", "minfer", *command], cwd=where).returncode
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("prepare").add_argument("specs", nargs="+", metavar="NAME=REF[:PATCH]")
    runner = sub.add_parser("run")
    runner.add_argument("--rounds", type=int, default=2)
    runner.add_argument("command", nargs=argparse.REMAINDER, help="-- then the minfer subcommand")
    args = parser.parse_args()
    if args.what == "prepare":
        prepare(args.specs)
    else:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        sys.exit(run(args.rounds, command))


if __name__ == "__main__":
    main()
