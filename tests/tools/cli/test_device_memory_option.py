"""``--device-memory`` values are checked before anything starts and printed in the unit given: a
negative value is the option's own one line (not argparse's "expected one argument"), a device too
small for the model states of any strategy is refused before the planner's setup, and sizes read
``1K``, not ``0.0M``."""
import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.runtime_memory import bytes_text, check_documents_fit, least_state_bytes
from hgraph.tools.cli import main


@pytest.mark.parametrize("n, text", [(1024, "1K"), (512 * 2 ** 20, "512M"), (1.5 * 2 ** 30, "1.5G"),
                                     (13484258, "12.86M"), (100, "100"), (None, "none")])
def test_sizes_read_in_the_unit_given(n, text):
    assert bytes_text(n) == text


@pytest.mark.parametrize("argv", [
    ["train", "--device-memory", "-5G"],
    ["memory", "--model", "tiny", "--strategy", "2xTP2PP1", "--device-memory", "-5G"],
    ["plan", "--lengths", "x.txt", "--profile", "llama-7b", "--world-size", "8", "--max-len", "4096",
     "--tokens-per-iter", "8192", "--device-memory", "-1.5G"],
])
def test_a_negative_size_is_the_option_s_own_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("100\n200\n")
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "expected one argument" not in err[0]
    assert f"--device-memory '{argv[-1]}': expected a positive number of bytes" in err[0]


def test_a_device_too_small_for_the_model_states_is_refused_before_any_process(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["train", "--device-memory", "1K", "--steps", "2", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("hgraph train: error: --device-memory 1K: too small for any strategy; every rank of 4 "
                             "holds at least 1.194M of model states (250,432 parameters")
    assert not (tmp_path / "run").exists()              # nothing started: no run folder, no planner setup
    assert least_state_bytes(250_432, 4) == 250_432 * 20 / 4


def test_a_document_no_scheme_holds_names_the_limit_in_its_unit():
    class Cost:                      # the two things check_documents_fit asks of a cost model
        schemes, name = ["TP1PP1"], "x"

        @staticmethod
        def max_len(_scheme):
            return 0
    with pytest.raises(HGraphError, match=r"under --device-memory 1K \(largest MaxLen 0 tokens"):
        check_documents_fit(np.array([10]), Cost, 1024.0)
