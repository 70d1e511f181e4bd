"""Settings for every test run from this checkout (the README's command, tox's envs).

``pytest -n auto`` starts one worker per core, so a worker's torch ops and every process a test
starts compute on one thread unless they ask for more: more threads than cores only contend (on
2 cores, the data and model tests took 10% more time with torch's default of one per core).
Set here, before any test module imports torch; an ``OMP_NUM_THREADS`` already set is kept.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
