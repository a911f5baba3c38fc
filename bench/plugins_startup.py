"""Wall time of `loom plugins` (process start, LibTorch load, scanning and loading every plugin,
printing the table): the median of several runs, with the plugin count. A benchmark, not a test.

    python3 bench/plugins_startup.py [--runs 15] [--loom build/bin/loom] [--plugin-dir DIR]
"""
import argparse
import os
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

p = argparse.ArgumentParser()
p.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
p.add_argument("--runs", type=int, default=15)
p.add_argument("--plugin-dir", action="append", default=[])
a = p.parse_args()
cmd = [a.loom, "plugins"] + [x for d in a.plugin_dir for x in ("--plugin-dir", d)]
subprocess.run(cmd, capture_output=True, check=True)  # warm the page cache
times = []
for _ in range(a.runs):
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    times.append(time.perf_counter() - t)
count = next((l for l in out.splitlines() if "component(s) from" in l), "").split(".")[0]
print(f"loom plugins: median {statistics.median(times) * 1000:.0f} ms over {a.runs} runs "
      f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}); {count}")
