#!/usr/bin/env python3
"""Compares devtrace's memory_profile JSON with XProf's own converter.

    compare_memory_profile.py PATH.xplane.pb OUR.json

Runs XProf's `memory_profile` tool (xprof.convert.raw_to_tool_data) on a copy
of the trace in a temporary directory (XProf writes cache files next to it),
then compares field by field: memory ids, hosts, version, HLO modules, and
per allocator the summary (peak bytes, peak time, capacity), the active
allocations and the snapshots they point at, the special allocations and
the sampled timeline. Numbers are compared as the text each side printed,
so a formatting difference is a mismatch too.

Two orders XProf leaves unspecified are compared as sets: which of several
identical active allocations (numOccurrences > 1) represents them, and the
order of timeline snapshots with equal times.

Exit status: 0 when they match, 1 on any difference, 2 when the comparison
could not run.
"""

import json
import os
import shutil
import sys
import tempfile

KEY_FIELDS = (
    "memoryActivity",
    "allocationBytes",
    "requestedBytes",
    "tfOpName",
    "regionType",
    "dataType",
    "tensorShape",
)


def load(text):
    # Keep numbers as the text that was printed.
    return json.loads(text, parse_float=str, parse_int=str)


def xprof_json(xplane):
    from xprof.convert import raw_to_tool_data as r2t

    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "plugins", "profile", "run")
        os.makedirs(run)
        name = os.path.basename(xplane)
        if not name.endswith(".xplane.pb"):
            name = "host.xplane.pb"
        copy = os.path.join(run, name)
        shutil.copyfile(xplane, copy)
        data, _ = r2t.xspace_to_tool_data([copy], "memory_profile", {})
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    return data or ""


class Diff:
    def __init__(self):
        self.problems = []
        self.notes = []

    def check(self, what, ours, theirs):
        if ours != theirs:
            self.problems.append(f"{what}: ours {short(ours)} != xprof {short(theirs)}")
            return False
        return True


def short(value, limit=300):
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


def canon(value):
    return json.dumps(value, sort_keys=True)


def compare_timeline(diff, what, ours, theirs):
    if not diff.check(f"{what}: count", len(ours), len(theirs)):
        return
    # Runs of equal times may come in any order.
    i = 0
    while i < len(theirs):
        j = i
        while j + 1 < len(theirs) and theirs[j + 1].get("timeOffsetPs") == theirs[i].get("timeOffsetPs"):
            j += 1
        a = sorted(canon(s) for s in ours[i : j + 1])
        b = sorted(canon(s) for s in theirs[i : j + 1])
        if a != b:
            for k in range(i, j + 1):
                if canon(ours[k]) != canon(theirs[k]):
                    diff.check(f"{what}[{k}]", ours[k], theirs[k])
                    break
            if len(diff.problems) > 40:
                return
        if j > i:
            diff.notes.append(f"{what}: {j - i + 1} snapshots share time {theirs[i].get('timeOffsetPs')}")
        i = j + 1


def compare_allocator(diff, name, ours, theirs):
    what = f"allocator {name}"
    diff.check(f"{what}: profileSummary", ours.get("profileSummary"), theirs.get("profileSummary"))
    diff.check(
        f"{what}: specialAllocations", ours.get("specialAllocations"), theirs.get("specialAllocations")
    )
    compare_timeline(
        diff,
        f"{what}: sampledTimelineSnapshots",
        ours.get("sampledTimelineSnapshots", []),
        theirs.get("sampledTimelineSnapshots", []),
    )
    a_rows = ours.get("activeAllocations", [])
    b_rows = theirs.get("activeAllocations", [])
    a_snaps = ours.get("memoryProfileSnapshots", [])
    b_snaps = theirs.get("memoryProfileSnapshots", [])
    diff.check(f"{what}: memoryProfileSnapshots count", len(a_snaps), len(b_snaps))
    if not diff.check(f"{what}: activeAllocations count", len(a_rows), len(b_rows)):
        return
    for k, (a, b) in enumerate(zip(a_rows, b_rows)):
        row = f"{what}: activeAllocations[{k}]"
        if not diff.check(row, a, b):
            continue
        index = int(b.get("snapshotIndex", "0"))
        if index < 0:
            continue
        if index >= len(a_snaps) or index >= len(b_snaps):
            diff.problems.append(f"{row}: snapshotIndex {index} out of range")
            continue
        a_snap, b_snap = a_snaps[index], b_snaps[index]
        if int(b.get("numOccurrences", "1")) > 1:
            # Which of the identical allocations XProf keeps depends on hashing.
            a_key = {f: a_snap.get("activityMetadata", {}).get(f) for f in KEY_FIELDS}
            b_key = {f: b_snap.get("activityMetadata", {}).get(f) for f in KEY_FIELDS}
            diff.check(f"{row}: snapshot (merged, key fields)", a_key, b_key)
            if canon(a_snap) != canon(b_snap):
                diff.notes.append(
                    f"{row}: {b.get('numOccurrences')} identical allocations, represented "
                    "by a different one of them (XProf's choice follows hash order)"
                )
        else:
            diff.check(f"{row}: snapshot", a_snap, b_snap)


def summary_line(name, allocator):
    summary = allocator.get("profileSummary", {})
    peak = summary.get("peakStats", {})
    return (
        f"  {name}: {len(allocator.get('sampledTimelineSnapshots', []))} timeline snapshots, "
        f"peak {peak.get('peakBytesInUse')} bytes (heap {peak.get('heapAllocatedBytes')}, "
        f"stack {peak.get('stackReservedBytes')}) at {summary.get('peakStatsTimePs')} ps, "
        f"{len(allocator.get('activeAllocations', []))} active allocation rows, "
        f"{len(allocator.get('specialAllocations', []))} special"
    )


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    xplane, ours_path = argv[1], argv[2]
    try:
        theirs_text = xprof_json(xplane)
    except Exception as e:  # noqa: BLE001 - report any converter failure
        print(f"cannot run XProf's converter: {e!r}", file=sys.stderr)
        return 2
    with open(ours_path, encoding="utf-8") as f:
        ours_text = f.read()
    if not theirs_text.strip() or not ours_text.strip():
        if theirs_text.strip() == ours_text.strip():
            print("both empty: match")
            return 0
        print(f"one side is empty: ours {len(ours_text)} bytes, xprof {len(theirs_text)} bytes")
        return 1
    ours, theirs = load(ours_text), load(theirs_text)
    diff = Diff()
    for field in ("memoryIds", "numHosts", "version", "hloModules"):
        diff.check(field, ours.get(field), theirs.get(field))
    a_map = ours.get("memoryProfilePerAllocator", {})
    b_map = theirs.get("memoryProfilePerAllocator", {})
    diff.check("allocators", sorted(a_map), sorted(b_map))
    print(f"xprof: {len(b_map)} allocators, memoryIds {theirs.get('memoryIds')}")
    for name in sorted(set(a_map) & set(b_map)):
        print(summary_line(name, b_map[name]))
        compare_allocator(diff, name, a_map[name], b_map[name])
    if ours == theirs:
        print("identical documents (numbers compared as printed)")
    for note in diff.notes[:20]:
        print(f"note: {note}")
    if diff.problems:
        for problem in diff.problems[:40]:
            print(f"MISMATCH {problem}")
        print(f"{len(diff.problems)} differences")
        return 1
    print("match")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
