"""Settings for every test run from this checkout (the README's command, tox's envs).

``pytest -n auto`` starts one worker per core, so a worker's torch ops and every process a test
starts compute on one thread unless they ask for more: more threads than cores only contend (on
2 cores, the data and model tests took 10% more time with torch's default of one per core).
Set here, before any test module imports torch; an ``OMP_NUM_THREADS`` already set is kept.
Those processes also get a temporary directory of this run's (the fixture below).
"""

import getpass
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


SOCKETS_BELOW_TMPDIR = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
"""The Unix socket paths multiprocessing makes below ``TMPDIR`` (loader workers pass tensors
through them) add this much, and a socket path has at most 103 bytes on macOS, 107 on Linux."""
SOCKET_PATH_MAX = 103


@pytest.fixture(scope="session", autouse=True)
def temp_dir_of_started_processes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path | None]:
    """The ``TMPDIR`` of every process a test starts: ``tmp`` in this run's pytest basetemp.

    What those processes leave in their temporary directory stays there, and pytest removes old
    basetemps: torchrun makes a ``torchelastic_*`` tree per launch and never removes it, and a
    process killed with SIGKILL cannot remove its multiprocessing ``pymp-*`` folder, so a run
    used to leave a dozen of them in the machine's /tmp. This process keeps its own temporary
    directory (pytest has read it), and started processes keep the machine's inductor cache
    (torch's default place), shared between runs as before. A test may set its own ``TMPDIR``.

    None, and the machine's ``TMPDIR`` kept, where the folder's path is too long for the sockets
    made below it (a long user name, macOS's /var/folders/...): under /tmp there is room for a
    29-character user name with 9,999 pytest runs and 99 workers.
    """
    folder = tmp_path_factory.getbasetemp() / "tmp"
    if len(str(folder)) + SOCKETS_BELOW_TMPDIR > SOCKET_PATH_MAX:
        yield None
        return
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # torch's default cache's name
    machine_cache = Path(tempfile.gettempdir(), f"torchinductor_{user}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(machine_cache))  # not below `folder`
    folder.mkdir()
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    yield folder
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before
