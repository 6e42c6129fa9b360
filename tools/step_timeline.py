#!/usr/bin/env python3
"""The engine's step timeline from a server log written with
`RUST_LOG=info,berrylm=debug`: every forward the plugin ran (its sequences,
tokens per sequence and start time, from the `berrylm forward:` lines), the
decode and prompt steps by size, and the time from each forward's start to
the next one's (its forward plus the engine's work around it). Standard
library only.
"""

import argparse
import os
import re
import sys
from datetime import datetime

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FORWARD = re.compile(r"^(\S+?)Z? .*berrylm forward: (\d+) sequences x (\d+) tokens")


def forwards(path):
    """(start s, sequences, tokens per sequence) of every forward in the log."""
    found = []
    with open(path, errors="replace") as log:
        for line in log:
            match = FORWARD.search(ANSI.sub("", line))
            if match:
                start = datetime.fromisoformat(match.group(1)).timestamp()
                found.append((start, int(match.group(2)), int(match.group(3))))
    return found


def quantile(values, q):
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="the server's log")
    parser.add_argument("--long-ms", type=float, default=40.0,
                        help="list the steps whose next forward started later than this")
    args = parser.parse_args()

    steps = forwards(args.log)
    if len(steps) < 2:
        raise SystemExit(f"{args.log}: fewer than two `berrylm forward` lines (RUST_LOG=berrylm=debug?)")
    first = steps[0][0]
    gaps = [(after[0] - before[0], before) for before, after in zip(steps, steps[1:])]
    decode = [gap for gap, (_, _, tokens) in gaps if tokens == 1]
    prompt = [gap for gap, (_, _, tokens) in gaps if tokens > 1]
    sizes = {}
    for _, rows, tokens in steps:
        if tokens == 1:
            sizes[rows] = sizes.get(rows, 0) + 1
    prompts = [(rows, tokens) for _, rows, tokens in steps if tokens > 1]

    print(f"{len(steps)} forwards over {steps[-1][0] - first:.2f} s")
    print("decode steps by sequences:", ", ".join(f"{r}: {n}" for r, n in sorted(sizes.items())))
    print(f"prompt steps (sequences x tokens): {len(prompts)}:", prompts)
    print(f"decode step to next forward, ms: p10 {quantile(decode, .1) * 1e3:.2f}, "
          f"p50 {quantile(decode, .5) * 1e3:.2f}, p90 {quantile(decode, .9) * 1e3:.2f}, "
          f"max {max(decode, default=0) * 1e3:.1f}; {sum(decode):.2f} s in all")
    print(f"prompt step to next forward, ms: p50 {quantile(prompt, .5) * 1e3:.1f}, "
          f"max {max(prompt, default=0) * 1e3:.1f}; {sum(prompt):.2f} s in all")
    print(f"steps followed by more than {args.long_ms:g} ms (start ms, sequences, tokens, ms):")
    for gap, (start, rows, tokens) in gaps:
        if gap * 1e3 > args.long_ms:
            print(f"  {(start - first) * 1e3:9.1f} {rows:4d} {tokens:6d} {gap * 1e3:8.1f}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        # Read by `head`, which has what it wants: Python's own advice, stdout onto /dev/null so
        # that the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
