"""Where a step's device time goes, from a Chrome trace of `loom profile` on CUDA: the kernels'
(and device copies' and memsets') time per step, grouped by the operator that launched them and by
kernel, largest first, and the total beside the host's time per step.

    python bench/gpu_kernels.py TRACE.json STEPS [--top 25]

A kernel is attributed to the operator through the trace's "External id" (Kineto gives the launch
and its kernel the id of the innermost operator running on the host at the launch); Loom's own
kernels (compiled at run time, launched with cuLaunchKernel) show under their loom_* names.
"""
import argparse
import collections
import json


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
    for title, counter in (("operator", by_op), ("kernel", by_kernel)):
        print(f"\n| {title} | ms per step | share |\n| --- | --- | --- |")
        for name, us in counter.most_common(a.top):
            print(f"| {name} | {us / a.steps / 1000:.3f} | {100 * us / total:.1f} % |")


if __name__ == "__main__":
    main()
