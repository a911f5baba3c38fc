"""Where a step's device time goes, from a Chrome trace of `loom profile` on CUDA: the kernels'
(and device copies' and memsets') time per step, grouped by the operator that launched them and by
kernel, largest first, and the total beside the host's time per step.

    python bench/gpu_kernels.py TRACE.json STEPS [--top 25]

A kernel is attributed to the operator through the trace's "External id" (Kineto gives the launch
and its kernel the id of the innermost operator running on the host at the launch); Loom's own
kernels (compiled at run time, launched with cuLaunchKernel) show under their loom_* names.

Then the device's idle time between kernels on its busiest stream, by the gap's length: gaps of a
few microseconds are the cost of starting each kernel (a step of many small kernels pays it many
times: fewer kernels, or a CUDA graph, is the cure); gaps of tens of microseconds to a millisecond
are the host falling behind its launches; longer ones are waits at the step's boundaries (the
profiler reads each step's values).
"""
import argparse
import collections
import json

# gap lengths in microseconds: [0, 10) the start of the next kernel, [10, 1000) the host behind,
# [1000, inf) a wait
GAP_CLASSES = ((10.0, "under 10 us (starting the next kernel)"), (1000.0, "10 us to 1 ms (the host behind)"),
               (float("inf"), "1 ms and longer (waits)"))


def stream_gaps(device_events):
    """The busiest stream's id, its kernel time and, per class of GAP_CLASSES, the summed idle time
    and count of the gaps between its consecutive kernels (microseconds)."""
    streams = collections.defaultdict(list)
    for e in device_events:
        if e.get("cat") == "kernel":
            streams[e.get("args", {}).get("stream")].append(e)
    if not streams:
        return None
    stream, kernels = max(streams.items(), key=lambda item: sum(k["dur"] for k in item[1]))
    kernels.sort(key=lambda k: k["ts"])
    sums, counts = [0.0] * len(GAP_CLASSES), [0] * len(GAP_CLASSES)
    end = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        gap = k["ts"] - end
        if gap > 0:
            i = next(i for i, (limit, _) in enumerate(GAP_CLASSES) if gap < limit)
            sums[i] += gap
            counts[i] += 1
        end = max(end, k["ts"] + k["dur"])
    return stream, sum(k["dur"] for k in kernels), sums, counts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("steps", type=int)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    with open(a.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ops = {e["args"]["External id"]: e["name"] for e in events
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_op, by_kernel = collections.Counter(), collections.Counter()
    for e in device:
        op = ops.get(e.get("args", {}).get("External id"), "(no operator)")
        by_op[op] += e["dur"]
        by_kernel[e["name"][:90]] += e["dur"]
    total = sum(by_op.values())
    steps = [e for e in events if e.get("name", "").startswith("loom::step")]
    host = sum(e["dur"] for e in steps) / max(1, len(steps)) if steps else None
    print(f"device time per step: {total / a.steps / 1000:.2f} ms over {len(device)} kernels and copies "
          f"({len(device) / a.steps:.0f} per step)" + (f"; host time per step: {host / 1000:.2f} ms" if host else ""))
    gaps = stream_gaps(device)
    if gaps:
        stream, busy, sums, counts = gaps
        print(f"\nstream {stream}, the busiest: {busy / a.steps / 1000:.2f} ms of kernels per step; idle between them:")
        print("\n| gap | ms per step | gaps per step |\n| --- | --- | --- |")
        for (_, label), us, n in zip(GAP_CLASSES, sums, counts):
            print(f"| {label} | {us / a.steps / 1000:.3f} | {n / a.steps:.0f} |")
    for title, counter in (("operator", by_op), ("kernel", by_kernel)):
        print(f"\n| {title} | ms per step | share |\n| --- | --- | --- |")
        for name, us in counter.most_common(a.top):
            print(f"| {name} | {us / a.steps / 1000:.3f} | {100 * us / total:.1f} % |")


if __name__ == "__main__":
    main()
