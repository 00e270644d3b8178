"""Files the GPU workloads and scripts/gpu-check exchange: each is written
to a temporary name and renamed into place, so a reader never sees half."""

import json
import os
import traceback


def touch(path, text=""):
    """Creates the signal file `path` holding `text`."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path, doc):
    """Writes `doc` as the JSON file `path`."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def run_to_file(path, run, skipped=()):
    """Runs `run()` and writes what it answers as the JSON file `path`;
    answers the exit status: 0, 3 when it raised one of `skipped` (written
    as {"skip": ...}: the workload cannot run here), 1 when it raised
    anything else (written as {"error": ..., "traceback": ...})."""
    try:
        result = run()
    except skipped as e:
        write_json(path, {"skip": f"{type(e).__name__}: {e}"})
        return 3
    except Exception as e:  # noqa: BLE001 - the result says what went wrong
        write_json(path, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return 1
    write_json(path, result)
    return 0
