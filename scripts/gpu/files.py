"""Files the GPU workloads and scripts/gpu-check exchange: each is written
to a temporary name and renamed into place, so a reader never sees half."""

import json
import os


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
