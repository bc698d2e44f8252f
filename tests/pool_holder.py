"""A runner process's turn on the GPU pool, for tests/test_scale.py to start in processes of their own: this
module imports the pool alone, so each new interpreter starts in a fraction of a second instead of importing
the test module's torch, MLflow and Hydra first."""

import json
import time

from pipeline.placement import GpuPool


def hold_a_gpu(folder, devices, log, hold_s):
    """Take one device of the pool in `folder`, hold it `hold_s` seconds, and log [device, start, end]."""
    with GpuPool(folder, devices).take(1) as (device,):
        start = time.time()
        time.sleep(hold_s)
        with open(log, "a") as file:
            file.write(json.dumps([device, start, time.time()]) + "\n")
