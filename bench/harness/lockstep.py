#!/usr/bin/env python3
"""Time several training processes in lockstep: each runs a few steps while the others are
stopped, in turns, so that every comparison is between steps seconds apart.

Why: on the 2-core machines here a step's time drifts by ~10% within a minute and single steps
spread by up to +-30% (GPT 8x256 bf16 in PyTorch: 0.85-1.41 s, one process, twelve steps in a
row). Whole runs one after another (each paying start-up, profiling, warm-up) compare only
minutes apart; here every process starts once, warms up alone, and then the processes take
turns: SIGCONT one, read its step lines, SIGSTOP it, next. A step's time is the interval
between two consecutive step lines seen by this script.

In each turn of `steps_per_turn` lines, the first line ends the step that was under way when
the process was stopped (its interval includes the pause: not a sample) and the next `skip`
intervals run with caches the other processes emptied (left out too); the remaining intervals
are the turn's samples. A process's time in a turn is the median of its samples; ratios are
taken turn by turn (seconds apart) and their median over turns is the result.

Any command that prints one line per finished step, flushed, works: `memfit train` (its
progress lines, "step K/N") and `pytorch_twin.py --stream` ("step K ...").

    python3 bench/harness/lockstep.py --turns 12 --steps-per-turn 4 -- 'CMD A' 'CMD B' ...

prints each command's median step and its ratio to the first command's, turn by turn.
"""
import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

STEP_LINE = re.compile(r"\bstep (\d+)")


class Stepper:
    """One training process whose step lines are read with the time they arrive."""

    def __init__(self, argv, log):
        self.argv = argv
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                     start_new_session=True)
        self.lines = []  # every line read, for the caller (a plan printed before the steps)

    def next_step(self):
        """Blocks until the next step line; returns its arrival time (monotonic seconds)."""
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if STEP_LINE.search(line):
                return time.monotonic()
        self.proc.wait()
        raise RuntimeError("lockstep: %s ended (exit %s) before its steps did; its stderr is in %s"
                           % (shlex.join(self.argv), self.proc.returncode, self.log.name))

    def signal(self, sig):
        os.killpg(self.proc.pid, sig)

    def stop(self):
        self.signal(signal.SIGSTOP)

    def resume(self):
        self.signal(signal.SIGCONT)

    def kill(self):
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def run_lockstep(commands, turns, steps_per_turn, skip=1, warmup_steps=2, log_dir="/tmp", on_turn=None):
    """Each command (an argv list) warms up alone for `warmup_steps` step lines, then all take
    `turns` turns of `steps_per_turn` step lines. Returns, per command, per turn, the list of
    sample step seconds; `on_turn(t)` is called after each turn (progress)."""
    if steps_per_turn < skip + 2:
        raise ValueError("steps_per_turn must be at least skip + 2 (one paused step, skip cold ones, one sample)")
    steppers = []
    try:
        for i, argv in enumerate(commands):
            log = open(os.path.join(log_dir, "lockstep_%d_%d.err" % (os.getpid(), i)), "w")
            s = Stepper(argv, log)
            for _ in range(warmup_steps):  # alone: start-up, planning and first use are not timed
                s.next_step()
            s.stop()
            steppers.append(s)
        samples = [[] for _ in commands]
        for t in range(turns):
            for s, out in zip(steppers, samples):
                s.resume()
                stamps = [s.next_step() for _ in range(steps_per_turn)]
                s.stop()
                out.append([b - a for a, b in zip(stamps[skip:], stamps[skip + 1:])])
            if on_turn:
                on_turn(t)
        return samples, [s.lines for s in steppers]
    finally:
        for s in steppers:
            s.kill()


def turn_medians(samples):
    """Per command, its median sample of each turn."""
    return [[statistics.median(turn) for turn in per_command] for per_command in samples]


def quartiles(values):
    """The lower and upper quartile (both the value itself when there is one)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def ratio_by_turn(a, b):
    """Turn-by-turn ratios of two commands' turn medians, and their median."""
    ratios = [x / y for x, y in zip(a, b)]
    return statistics.median(ratios), ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--steps-per-turn", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1, help="cold intervals left out at the start of each turn")
    ap.add_argument("--warmup", type=int, default=2, help="step lines each command runs alone first")
    ap.add_argument("commands", nargs="+", help="shell-quoted commands; the first is the reference")
    a = ap.parse_args()
    print("command: python3 bench/harness/lockstep.py --turns %d --steps-per-turn %d --skip %d --warmup %d -- %s"
          % (a.turns, a.steps_per_turn, a.skip, a.warmup, " ".join(shlex.quote(c) for c in a.commands)))
    samples, _ = run_lockstep([shlex.split(c) for c in a.commands], a.turns, a.steps_per_turn, a.skip, a.warmup,
                              on_turn=lambda t: print("turn %d/%d" % (t + 1, a.turns), file=sys.stderr))
    medians = turn_medians(samples)
    for i, c in enumerate(a.commands):
        ratio, each = ratio_by_turn(medians[i], medians[0])
        low, high = quartiles(each)
        print("%.4f s  x%.3f (turns: quartiles %.3f-%.3f)  %s" % (statistics.median(medians[i]), ratio, low, high, c))


if __name__ == "__main__":
    main()
