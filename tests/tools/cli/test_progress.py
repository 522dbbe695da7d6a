"""Progress bars: redrawn in place on a terminal, plain lines (no control characters) otherwise."""
import io

import pytest

from hgraph.tools.cli.progress import Progress, resolve_mode


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_without_a_terminal_only_plain_lines_are_written():
    out = io.StringIO()
    with Progress(3, "calibrating", plain=True, stream=out) as bar:
        bar.update(1, "compute")
        bar.write("a line of the log")
        bar.update(1)                      # no note: nothing to say in a log
        bar.update(1, "proposal")
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == ["calibrating: compute (1/3)", "a line of the log", "calibrating: proposal (3/3)"]


def test_on_a_terminal_the_bar_is_redrawn_and_lines_go_above_it():
    out = Tty()
    bar = Progress(4, "training", enabled=resolve_mode("auto", out), stream=out, width=8)
    bar.update(1, "step 0")
    assert out.getvalue().endswith("training [##------] 1/4 step 0  0s")
    bar.write("step    0  4xTP1PP1")
    bar.update(3, "step 3")
    bar.close()
    text = out.getvalue()
    assert "\r\x1b[2Kstep    0  4xTP1PP1\n\r\x1b[2Ktraining [##------] 1/4" in text
    assert "training [########] 4/4 step 3" in text and text.endswith("\r\x1b[2K")


def test_modes():
    assert resolve_mode("auto", io.StringIO()) is False and resolve_mode("auto", Tty()) is True
    assert resolve_mode("on", io.StringIO()) is True and resolve_mode("off", Tty()) is False
    with pytest.raises(ValueError, match="allowed are auto, on, off"):
        resolve_mode("sometimes")
