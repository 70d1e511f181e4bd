"""On PYTHONPATH, makes ``forkserver`` the default start method, as Python 3.14 does on Linux."""

import multiprocessing

multiprocessing.set_start_method("forkserver")
