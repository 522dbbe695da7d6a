"""``runtime.process.fork_server`` cuts short the exit of the ranks' fork server only: imported anywhere
else it registers nothing, so a program that imports it still exits with its own code. (Inside the
server, its effect, every process of a run gone within a second of its launcher's SIGKILL, is
tested in ``tests/tools/cli/test_process_lifetime.py``.)"""
import subprocess
import sys

from hgraph.runtime.process import fork_server


def test_imported_outside_the_fork_server_it_registers_nothing():
    # the module's own file in a bare interpreter (it imports only the standard library)
    code = ("import atexit, multiprocessing.forkserver, runpy, sys; before = atexit._ncallbacks(); "
            f"runpy.run_path({fork_server.__file__!r}); "
            "assert atexit._ncallbacks() == before; sys.exit(3)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 3
