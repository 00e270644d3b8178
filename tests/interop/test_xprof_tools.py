"""XProf's own converters on the agent's first trace: the tools it offers, the
trace viewer (whole and streamed), the overview page, the memory profile
and kernel stats."""

from harness import *  # noqa: F401,F403 - the harness is these tests' vocabulary


def test_tool_names(run):
    names = run.conv.tool_names()
    check(isinstance(names, list) and names, "no tools offered: %r" % (names,))
    check("trace_viewer@" in names or "trace_viewer" in names, "no trace viewer in %s" % names)
    for t in ("overview_page", "memory_profile"):
        check(t in names, "%s not offered; offered: %s" % (t, names))
    if run.expects_gpu:
        check("kernel_stats" in names, "kernel_stats not offered (needs a /device:GPU:N plane); "
              "offered: %s" % names)
    return ",".join(names)


def _check_trace_viewer(run, tool):
    doc = run.conv.tool_json(tool)
    procs, n = trace_processes(doc, tool)

    def events_of(suffix):
        return sum(c for name, c in procs.items() if name == suffix or name.endswith(" " + suffix))

    check(events_of("/host:CPU") > 0, "%s: no events in a /host:CPU process; processes: %s"
          % (tool, procs))
    if run.expects_gpu:
        check(events_of("/device:GPU:0") > 0, "%s: no events in a /device:GPU:0 process; "
              "processes: %s" % (tool, procs))
    if run.expects_sched and tool == "trace_viewer@":
        # The streaming viewer shows every plane whose name starts with /host:CPU.
        check(events_of("/host:CPUs") > 0, "%s: no events in the scheduler's /host:CPUs process; "
              "processes: %s" % (tool, procs))
    return "%d trace events; processes(events): %s" % (n, procs)


def test_trace_viewer_streaming(run):
    names = run.conv.tool_names()
    if "trace_viewer@" not in names:
        raise SkipTest("trace_viewer@ not offered (%s)" % names)
    return _check_trace_viewer(run, "trace_viewer@")


def test_trace_viewer(run):
    return _check_trace_viewer(run, "trace_viewer")


def test_overview_page(run):
    doc = run.conv.tool_json("overview_page")
    check(isinstance(doc, list) and doc, "overview_page: expected a non-empty list of tables, got %s"
          % short(doc))
    steps = None
    for table in doc:
        if isinstance(table, dict) and any(c.get("id") == "stepnum" for c in table.get("cols", [])):
            steps = table.get("rows", [])
    check(steps is not None, "overview_page: no step-time table (column stepnum); %s" % short(doc))
    check(len(steps) > 0, "overview_page: step-time table has no rows (no `train` steps grouped)")
    first = steps[0]["c"][0].get("v") if isinstance(steps[0], dict) else steps[0]
    env = next((t.get("p", {}) for t in doc if isinstance(t, dict)
                and "device_type" in t.get("p", {})), {})
    return "%d tables; %d steps (first %r); device_type=%s device_core_count=%s" % (
        len(doc), len(steps), first, env.get("device_type"), env.get("device_core_count"))


def test_memory_profile(run):
    doc = run.conv.tool_json("memory_profile")
    per = doc.get("memoryProfilePerAllocator") if isinstance(doc, dict) else None
    check(isinstance(per, dict) and per, "memory_profile: no allocators in memoryProfilePerAllocator "
          "(needs MemoryAllocation events with int64 stats on the /host:CPU plane): %s" % short(doc))
    good = []
    report = []
    for name, prof in per.items():
        snaps = len(prof.get("sampledTimelineSnapshots", [])) or len(prof.get("memoryProfileSnapshots", []))
        summ = prof.get("profileSummary", {})
        peak = int(summ.get("peakStats", {}).get("peakBytesInUse", "0") or 0)
        lifetime = int(summ.get("peakBytesUsageLifetime", "0") or 0)
        report.append("%s(snapshots=%d peak=%d lifetime_peak=%d active=%d)" % (
            name, snaps, peak, lifetime, len(prof.get("activeAllocations", []))))
        if snaps > 0 and (peak > 0 or lifetime > 0):
            good.append(name)
    check(good, "memory_profile: no allocator has snapshots and a non-zero peak: %s" % report)
    check(doc.get("memoryIds"), "memory_profile: memoryIds empty")
    return "; ".join(report)


def test_kernel_stats(run):
    if not run.expects_gpu:
        names = run.conv.tool_names()
        check("kernel_stats" not in names, "kernel_stats offered without a GPU plane?")
        raise SkipTest("no GPU plane in this mode (kernel_stats correctly not offered)")
    doc = run.conv.tool_json("kernel_stats")
    check(isinstance(doc, dict) and isinstance(doc.get("cols"), list),
          "kernel_stats: expected a DataTable with cols/rows, got %s" % short(doc))
    cols = [c.get("id") for c in doc["cols"]]
    check("kernel_name" in cols, "kernel_stats: no kernel_name column: %s" % cols)
    ki = cols.index("kernel_name")
    rows = doc.get("rows") or []
    kernels = []
    for r in rows:
        cells = r.get("c", []) if isinstance(r, dict) else r
        if ki < len(cells) and isinstance(cells[ki], dict) and cells[ki].get("v"):
            kernels.append(str(cells[ki]["v"]))
    check(kernels, "kernel_stats: no kernel rows (kernels need duration > 0 and a kernel_details "
          "stat on a /device:GPU:N plane); %d rows: %s" % (len(rows), short(rows)))
    return "%d kernel rows, e.g. %s" % (len(kernels), kernels[:3])
