"""ExitOnSignal: a signal received while a temporary expert store exists ends the process the
signal's way even when the exception its handler raised was swallowed by C code (PyTorch turns an
exception raised mid-read into a TypeError, which a store reports as a failed read)."""

from __future__ import annotations

import os
import signal

import pytest

from moectl.offload.signals import ExitOnSignal


def _swallowed(signum: int) -> None:
    """Deliver ``signum`` to this process inside code that swallows whatever the handler raises."""
    try:
        os.kill(os.getpid(), signum)  # the handler runs at the next bytecode, inside this try
    except BaseException as err:  # what a C extension does: report something else
        assert isinstance(err, (SystemExit, KeyboardInterrupt))


@pytest.mark.parametrize(
    "name, expected",
    [("SIGTERM", SystemExit), ("SIGHUP", SystemExit), ("SIGINT", KeyboardInterrupt)],
)
def test_a_swallowed_exit_is_raised_again_when_the_store_closes(name, expected):
    signum = getattr(signal, name)
    default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    outer = signal.signal(signum, default)  # as a terminal gives it (under nohup or `&` they start ignored)
    try:
        _exit_raised_again(signum, expected)
    finally:
        signal.signal(signum, outer)


def _exit_raised_again(signum: int, expected: type[BaseException]) -> None:
    previous = signal.getsignal(signum)
    guard = ExitOnSignal()
    guard.install()
    try:
        assert signal.getsignal(signum) is not previous, "the default action is replaced"
        _swallowed(signum)
        assert guard.received == signum
    finally:
        with pytest.raises(expected) as info:
            guard.restore()
    if expected is SystemExit:
        assert info.value.code == 128 + signum
    assert signal.getsignal(signum) is previous, "the previous handler is back"
    guard.restore()  # nothing received since: returns


def test_a_signal_while_cleaning_up_waits_for_the_cleanup():
    guard = ExitOnSignal()
    guard.install()
    guard.hold = True
    os.kill(os.getpid(), signal.SIGTERM)  # handled here, between bytecodes: deferred, not raised
    cleaned = True
    with pytest.raises(SystemExit) as info:
        guard.restore()
    assert cleaned and info.value.code == 128 + signal.SIGTERM


def test_a_signal_with_its_own_handler_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        guard = ExitOnSignal()
        guard.install()
        os.kill(os.getpid(), signal.SIGTERM)
        guard.restore()  # not ours: nothing raised
        assert seen == [signal.SIGTERM] and guard.received is None
    finally:
        signal.signal(signal.SIGTERM, previous)
