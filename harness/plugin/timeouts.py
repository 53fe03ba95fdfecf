"""A test's timeout on this rank (``Watchdog``), what a rank torchrun stops does
(``Stopper``), and the end of a session that cannot go on (``end_session``: rank 0's partial
``summary.json``, labelled stacks); the state they share is the rank's ``RankSession``
(``harness.plugin.dist`` installs them: its docstring tells the whole story)."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from dataclasses import dataclass

import pytest

from harness.plugin.ranklog import DistEnv, RankLog
from harness.util import distributed


@dataclass(kw_only=True)
class RankSession:
    """This rank's session: its layout, its timeout, where its stacks go, and the test it is in
    (the plugin stashes one per session; the watchdog and the stopper read it)."""

    env: DistEnv
    case_timeout: float
    """Seconds per test; 0 disables the timeout."""
    console_fd: int
    """A duplicate of the console's stderr (pytest captures fd 2 while a test runs)."""
    log: RankLog | None = None
    current: str | None = None
    """The test running now (its node id), for a report when torchrun stops this rank."""
    timed_out: str | None = None
    """The test whose ``--case-timeout`` fired on this rank and has not unwound yet: a stop by
    torchrun meanwhile is that timeout's consequence, and the summary says ``timed-out``."""
    stopper: Stopper | None = None


GRACE_S = 10.0
"""Seconds a timed-out test has to unwind after its ``CaseTimeout`` before the session ends
(``grace_s``: the case timeout itself when that is shorter)."""


def grace_s(case_timeout: float) -> float:
    """The unwinding time of a test that timed out after ``case_timeout`` seconds: ``GRACE_S``,
    or ``case_timeout`` when shorter (a test allowed 5 s gets 5 s more, not 10)."""
    return min(GRACE_S, case_timeout) if case_timeout > 0 else GRACE_S


BACKSTOP_S = 30.0
"""Seconds past timeout + grace after which ``faulthandler`` kills a rank whose watchdog thread
could not run (a C call holding the GIL): unlabelled stacks, but still bounded."""
INTERRUPT = signal.SIGUSR1
"""Sent to the main thread to raise ``CaseTimeout`` in a test past its timeout."""


class CaseTimeout(Exception):
    """Raised in a test's main thread when it runs past ``--case-timeout``."""


_PENDING: list[tuple[Watchdog, str]] = []  # the interrupt the next signal raises


def on_interrupt(signum: int, frame: object) -> None:
    if _PENDING:
        watchdog, label = _PENDING.pop()
        if not watchdog.waiting:  # only test code is interrupted, never the plugin's waits
            raise CaseTimeout(label)


def dump_stacks(session: RankSession, label: str) -> None:
    """``label`` and every thread's stack on the console and in the rank log."""
    targets = [session.console_fd]
    log_fd = session.log.fileno_or_none() if session.log is not None else None
    if log_fd is not None:
        targets.append(log_fd)
    for fd in targets:
        os.write(fd, f"\n{label}\n".encode())
        faulthandler.dump_traceback(file=fd, all_threads=True)


_ENDING = threading.Lock()
"""Held by the one thread that ends this process's session: a watchdog, the SIGTERM thread and
the main thread can each decide to end it at the same moment (a stuck rank's grace runs out as
torchrun stops it), and only the first writes the summary."""


def end_session(
    config: pytest.Config, session: RankSession, status: str, code: int = 1, **why: object
) -> None:
    """The session cannot go on: rank 0 writes a partial ``summary.json`` (``status``, and
    ``why`` under the status's name), the rank log is flushed, and the process exits ``code``.
    A second caller (another thread) blocks until the first one's exit."""
    _ENDING.acquire()  # never released: os._exit below
    collector = config.pluginmanager.get_plugin("offload-harness-report")
    if collector is not None and hasattr(collector, "write_early_end"):
        try:
            collector.write_early_end(status, **{status.replace("-", "_"): why})
        except Exception as exc:  # the stacks are out; say why the summary is not
            os.write(session.console_fd, f"summary.json not written: {exc!r}\n".encode())
    if session.log is not None:
        session.log.flush()
    os._exit(code)


class Watchdog:
    """One test's timeout on this rank. At ``case_timeout`` a thread writes ``rank R pid P timed
    out in <test id>`` and every thread's stack to the console and the rank log; if this rank is
    still in the test's code it raises ``CaseTimeout`` there, so the test fails and the session
    goes on. If the test has not unwound ``grace_s`` later (a rank stuck in a collective or in a
    C call), rank 0 writes a partial ``summary.json`` (the test, the ranks still inside it) and
    the process ends; torchrun then stops the other ranks."""

    def __init__(self, config: pytest.Config, session: RankSession, item: pytest.Item, tag: str):
        self.config, self.session, self.item, self.tag = config, session, item, tag
        self.waiting = False
        """True while this rank waits for the others (the plugin's rendezvous and barrier)."""
        self.timed_out = False
        self.ended = threading.Event()
        self.timer = threading.Timer(session.case_timeout, self.fire)
        self.timer.daemon = True

    def arm(self) -> None:
        self.timer.start()
        faulthandler.dump_traceback_later(
            self.session.case_timeout + grace_s(self.session.case_timeout) + BACKSTOP_S,
            exit=True,
            file=self.session.console_fd,
        )

    def disarm(self) -> None:
        self.ended.set()
        if self.session.timed_out == self.item.nodeid:
            self.session.timed_out = None
        self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()

    def inside(self) -> list[int]:
        """Ranks that have not finished the test's body (no outcome marked yet)."""
        return distributed.missing_ranks(f"{self.tag}/done")

    def fire(self) -> None:
        env = self.session.env
        self.timed_out = True
        self.session.timed_out = self.item.nodeid
        label = (
            f"rank {env.rank} pid {os.getpid()} timed out in {self.item.nodeid} after "
            f"{self.session.case_timeout:g} s (--case-timeout)"
        )
        inside = self.inside()
        if env.distributed:
            label += f"; ranks still inside it: {inside}" if inside else "; all ranks finished it"
        dump_stacks(self.session, label)
        waiting = self.waiting
        # The handler is installed only where pytest runs on the main thread; without it the
        # signal's default action would kill the process.
        if not waiting and signal.getsignal(INTERRUPT) is on_interrupt:
            _PENDING[:] = [(self, label)]
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT)
        # A waiting rank gives the others their grace first.
        grace = grace_s(self.session.case_timeout)
        if self.ended.wait(grace + (5.0 if waiting else 0.0)):
            return
        # This rank's test unwound during the grace and it now waits for the others: the ranks
        # still stuck end the job when their own grace runs out (rank 0 writing the summary);
        # ending it from here at the same moment would race them.
        if self.waiting and not waiting and self.ended.wait(5.0):
            return
        still = self.inside()
        final = (
            f"rank {env.rank} pid {os.getpid()}: {self.item.nodeid} did not end within "
            f"{grace:g} s of its timeout; ending the session"
        )
        if env.distributed:
            final += f" (ranks inside it at the timeout: {inside}; now: {still})"
        dump_stacks(self.session, final)
        end_session(
            self.config,
            self.session,
            "timed-out",
            test=self.item.nodeid,
            rank=env.rank,
            missing=inside,
            still_inside=still,
        )


class Stopper:
    """What a rank does when torchrun stops it with SIGTERM (another rank exited: it failed, timed
    out or was killed): write ``rank R pid P stopped by torchrun (SIGTERM) in <test id>`` and every
    thread's stack, flush the rank log, and on rank 0 write a partial ``summary.json`` (status
    ``aborted``: the test, the ranks that had not finished it), then exit 143.

    The work is done on a thread woken through ``signal.set_wakeup_fd``: the main thread may be
    blocked in a collective or a store wait, where a Python signal handler would never run."""

    def __init__(self, config: pytest.Config, session: RankSession, read_fd: int, write_fd: int):
        self.config, self.session = config, session
        self.read_fd, self.write_fd = read_fd, write_fd
        self.previous_handler = signal.getsignal(signal.SIGTERM)
        self.previous_fd = -1
        self.thread = threading.Thread(
            target=self.watch, name="offload-harness-sigterm", daemon=True
        )

    @classmethod
    def start(cls, config: pytest.Config, session: RankSession) -> Stopper | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        stopper = cls(config, session, read_fd, write_fd)
        # A Python-level handler, so the interpreter's C handler writes the wakeup byte.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        stopper.previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        stopper.thread.start()
        return stopper

    def watch(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                return
            if not data:  # the pipe was closed: the session ended
                return
            if signal.SIGTERM in data:
                self.stopped()

    def stopped(self) -> None:
        env, test = self.session.env, self.session.current
        where = f"in {test}" if test else "between tests"
        missing = distributed.missing_ranks(f"{test}/done", client="stopper") if test else []
        label = (
            f"rank {env.rank} pid {os.getpid()} stopped by torchrun (SIGTERM: another rank exited) "
            f"{where}"
        )
        if test and env.distributed:
            label += f"; ranks that had not finished it: {missing}"
        # Stopped while this rank's own test was past its timeout: the timeout is the cause.
        timed_out = test is not None and self.session.timed_out == test
        if timed_out:
            label += " after its --case-timeout"
        dump_stacks(self.session, label)
        end_session(
            self.config,
            self.session,
            "timed-out" if timed_out else "aborted",
            128 + signal.SIGTERM,
            test=test,
            rank=env.rank,
            signal="SIGTERM",
            missing=missing,
        )

    def stop(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self.previous_fd)
        signal.signal(signal.SIGTERM, self.previous_handler)
        os.close(self.write_fd)
        self.thread.join(timeout=5)
        os.close(self.read_fd)
