"""What long work tells the user: a progress bar on a terminal, nothing in a pipe.

Like the C++ Trainer's observers (include/memfit/train/events.h), the work itself prints
nothing: it calls an observer's ``on_progress(done, total, what)`` and ``on_note(text)``.
``progress=None`` (the default) draws a bar on stderr when stderr is a terminal; ``True`` always,
``False`` never; any object with those methods (or a function of (done, total, what)) receives the
events instead. Notes also go to the ``memfit`` logger.
"""
import logging
import sys
import time

logger = logging.getLogger("memfit")


class Observer:
    """Receives progress and notes; the default does nothing."""

    def on_progress(self, done, total, what):
        """`done` of `total` parts of the work are done; `what` names the last one."""

    def on_note(self, text):
        """A note for the user (a precision dropped, an out-of-memory split, what fit measured)."""

    def close(self):
        """The work is over (a bar clears its line)."""


class Bar(Observer):
    """A one-line progress bar on a stream (stderr), redrawn at most ten times a second."""

    def __init__(self, stream=None, width=24):
        self.stream = stream or sys.stderr
        self.width = width
        self.last = 0.0
        self.drawn = False

    def on_progress(self, done, total, what):
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        filled = int(self.width * done / max(total, 1))
        line = f"\rmemfit [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {what}"
        self.stream.write(line[:100].ljust(100))
        self.stream.flush()
        self.drawn = True

    def on_note(self, text):
        self.close()
        self.stream.write(f"memfit: {text}\n")
        self.stream.flush()

    def close(self):
        if self.drawn:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self.drawn = False


class _Function(Observer):
    def __init__(self, fn):
        self.fn = fn

    def on_progress(self, done, total, what):
        self.fn(done, total, what)


def observer(progress):
    """The observer `progress` (None, True, False, an observer or a function) asks for."""
    if progress is None:
        return Bar() if getattr(sys.stderr, "isatty", lambda: False)() else Observer()
    if progress is True:
        return Bar()
    if progress is False:
        return Observer()
    if hasattr(progress, "on_progress") or hasattr(progress, "on_note"):
        return progress
    if callable(progress):
        return _Function(progress)
    raise ValueError(f"progress {progress!r}: expected None, True, False, an observer or a function (done, total, what)")


def note(obs, text):
    """A note for the user: to the observer and the memfit logger."""
    logger.info(text)
    if hasattr(obs, "on_note"):
        obs.on_note(text)
