"""`loom profile`: a Chrome trace that trace viewers read, with Loom's phases as ranges that nest
inside each step and the operators inside them; the tables on the terminal; and what it refuses
(a trace path that exists is never replaced, absurd step counts).

The trace is read with Perfetto's trace processor when one is available (the `perfetto` Python
package plus a trace_processor_shell binary named by LOOM_TRACE_PROCESSOR: the package downloads
the binary on first use, which an offline machine cannot); otherwise it is checked against the
Chrome trace-event format (JSON object with traceEvents; complete events with name, ph, ts, dur,
pid, tid) as chrome://tracing and Perfetto's JSON importer read it."""
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

from common import loom, workdir

exe, source = sys.argv[1], sys.argv[2]
RUN = ["--set", "model.flavour=standard", "--set", "model.num_layers=1", "--set", "model.d_model=32",
       "--set", "model.num_heads=2", "--set", "model.patch_size=7", "--set", "model.stem_channels=4",
       "--set", "data.name=synthetic", "--set", "data.image_size=28", "--set", "data.train_size=512",
       "--set", "data.test_size=64", "--set", "trainer.batch_size=32", "--set", "trainer.device=cpu",
       "--set", "precision.name=fp32"]
PHASES = ["loom::step", "loom::data", "loom::forward", "loom::backward", "loom::reduce", "loom::report",
          "loom::optimizer"]
STEPS = 4


def expect(cond, what, result=None):
    if not cond:
        detail = f"\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}" if result is not None else ""
        raise SystemExit(f"FAIL: {what}{detail}")


def check_with_trace_processor(path):
    binary = os.environ.get("LOOM_TRACE_PROCESSOR")
    if not binary:
        return False
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
    tp = TraceProcessor(trace=path, config=TraceProcessorConfig(bin_path=binary))
    rows = {r.name: r.n for r in tp.query("select name, count(*) as n from slice where name like 'loom::%' group by name")}
    for phase in PHASES:
        expect(rows.get(phase, 0) >= 1, f"trace processor: {phase} slices in the trace (got {rows})")
    expect(rows["loom::step"] == STEPS, f"trace processor: {STEPS} step slices (got {rows['loom::step']})")
    print("trace read by Perfetto's trace processor:", rows)
    return True


def check_chrome_trace_format(path):
    with open(path) as f:
        trace = json.load(f)
    expect(isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list), "a JSON object with traceEvents")
    complete = []
    for e in trace["traceEvents"]:
        expect(isinstance(e, dict) and isinstance(e.get("ph"), str), f"every event has a phase type: {e}")
        if e["ph"] != "X":
            continue
        for key, kind in (("name", str), ("ts", (int, float)), ("dur", (int, float))):
            expect(isinstance(e.get(key), kind), f"complete event has {key}: {e}")
        expect("pid" in e and "tid" in e, f"complete event has pid and tid: {e}")
        expect(e["dur"] >= 0, f"non-negative duration: {e}")
        complete.append(e)
    steps = [e for e in complete if e["name"] == "loom::step"]
    expect(len(steps) == STEPS, f"{STEPS} loom::step ranges, got {len(steps)}")
    for phase in PHASES[1:]:
        ranges = [e for e in complete if e["name"] == phase]
        expect(ranges, f"{phase} ranges in the trace")
        for r in ranges:  # each phase lies inside a step of its thread
            expect(any(s["tid"] == r["tid"] and s["ts"] <= r["ts"] and r["ts"] + r["dur"] <= s["ts"] + s["dur"] + 1
                       for s in steps), f"{phase} at {r['ts']} inside a loom::step")
    forward = [e for e in complete if e["name"] == "loom::forward"]
    ops = [e for e in complete if e["name"].startswith("aten::")]
    expect(any(f["ts"] <= o["ts"] and o["ts"] + o["dur"] <= f["ts"] + f["dur"] + 1 and o["tid"] == f["tid"]
               for o in ops for f in forward), "operators (aten::*) recorded inside loom::forward")
    print(f"trace checked against the Chrome trace-event format: {len(complete)} complete events")


work = workdir()
trace = os.path.join(work, "profile.json")
r = loom(exe, "profile", *RUN, "--steps", str(STEPS), "--warmup", "2", "--trace", trace, "--top", "10")
for phase in PHASES:
    expect(phase in r.stdout, f"the phase table names {phase}", r)
expect("by self time" in r.stdout and "aten::" in r.stdout, "the operator table", r)
if "cuda" not in " ".join(RUN):
    expect("gpuGetDeviceCount" not in r.stderr and "USDT:" not in r.stderr and "profiler_start" not in r.stderr,
           "a CPU profile prints no line of Kineto's (an error about GPUs, its start and stop)", r)
expect(trace in r.stdout and "ui.perfetto.dev" in r.stdout, "says where the trace is and how to open it", r)
if not check_with_trace_processor(trace):
    check_chrome_trace_format(trace)

# --shapes --memory: rows per operator and input shapes, every allocation in the trace, and the
# operators that allocate by bytes. The stem's GELU ([32, 784, 4] floats) allocates its output,
# 401408 bytes, once per step: its row says so exactly, under its shapes.
traced = os.path.join(work, "memory.json")
r = loom(exe, "profile", *RUN, "--steps", str(STEPS), "--warmup", "2", "--trace", traced, "--top", "40",
         "--shapes", "--memory")
expect(any(line.startswith("aten::mm [") for line in r.stdout.splitlines()), "--shapes: operator rows with shapes", r)
expect("by memory it allocated itself" in r.stdout, "--memory: the allocating operators' table", r)
expect("loom profile times steps alone, without evaluation" in r.stderr and "evaluation every" not in r.stderr,
       "profile's start-up report announces no evaluation it never runs", r)
gelu = [line.split() for line in r.stdout.splitlines() if line.startswith("aten::gelu [32, 784, 4], []")]
expect(len(gelu) == 2, f"the stem's GELU in both tables ({gelu})", r)
allocs, mib = int(gelu[1][5]), float(gelu[1][6])
expect(allocs == STEPS and abs(mib - STEPS * 401408 / 2**20) < 0.006,
       f"the stem's GELU allocated {STEPS} x 401408 bytes (table: {allocs} allocations, {mib} MiB)", r)
with open(traced) as f:
    events = json.load(f)["traceEvents"]
memory = [e["args"]["Bytes"] for e in events if e.get("name") == "[memory]"]
expect(any(b > 0 for b in memory) and any(b < 0 for b in memory), "allocations and frees in the trace")
total = [line for line in r.stdout.splitlines() if line.endswith(f"MiB allocated in {STEPS} steps")]
expect(len(total) == 1 and abs(float(total[0].split()[0]) - sum(b for b in memory if b > 0) / 2**20) < 0.006,
       f"the total allocated is the trace's allocations ({total})", r)
expect(any("Input Dims" in e.get("args", {}) for e in events if e.get("ph") == "X"), "input shapes in the trace")

# The trace is never replaced: a second profile to the same path is refused, the file unchanged.
digest = hashlib.sha256(open(trace, "rb").read()).hexdigest()
r = loom(exe, "profile", *RUN, "--steps", "2", "--trace", trace, check=False)
expect(r.returncode != 0 and "already exists" in r.stderr, "an existing trace path is refused", r)
expect(hashlib.sha256(open(trace, "rb").read()).hexdigest() == digest, "the existing trace is unchanged")

# A run by epochs given to profile: its --steps set the length, said once; it was also told "set
# trainer.max_steps = 0 to train by epochs", which it had.
r = loom(exe, "profile", *RUN, "--set", "trainer.max_steps=0", "--set", "trainer.epochs=1", "--steps", "2", "--warmup", "1",
         "--trace", os.path.join(work, "by_epochs.json"))
expect("loom profile sets trainer.epochs: the value given, '1' (--set), is not used" in r.stderr
       and "to train by epochs" not in r.stderr, "a run by epochs under profile is told once that --steps sets its length", r)

# Without --trace, in a folder that holds a trace of the same second (two profiles in a script's
# loop): the next free name, -2 (the second was refused for a --trace it was never given).
here = os.path.join(work, "default_name")
os.makedirs(here)
start = time.time()
made = {time.strftime("loom-profile-%Y%m%d-%H%M%S.json", time.localtime(start + k)) for k in range(-1, 120)}
for name in made:
    with open(os.path.join(here, name), "w") as f:
        f.write("earlier")
r = loom(exe, "profile", *RUN, "--steps", "1", "--warmup", "0", cwd=here)
new = sorted(set(os.listdir(here)) - made)
expect(len(new) == 1 and new[0].endswith("-2.json") and new[0][:-len("-2.json")] + ".json" in made
       and all(open(os.path.join(here, n)).read() == "earlier" for n in made), f"the default trace name is the next free one: {new}", r)
# Two profiles started together in one folder (the same second: the same name chosen at the
# start): the second's trace took the next free name at its end (it was deleted, "a file of that
# name appeared while it ran").
together = os.path.join(work, "together")
os.makedirs(together)
runs = [subprocess.Popen([exe, "profile", *RUN, "--steps", "2", "--warmup", "0"], cwd=together, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True) for _ in range(2)]
outs = [p.communicate(timeout=300) for p in runs]
expect(all(p.returncode == 0 for p in runs) and len([f for f in os.listdir(together) if f.endswith(".json")]) == 2,
       f"two profiles at once: both traces written: {os.listdir(together)} {[o[1][-500:] for o in outs]}")
r = loom(exe, "profile", *RUN, "--trace", here, check=False)
expect(r.returncode != 0 and f"--trace {here} is a folder; give the trace's file name" in r.stderr, "a folder as --trace is named so", r)
r = loom(exe, "profile", *RUN, "--trace", "-", check=False, cwd=here)
expect(r.returncode != 0 and "--trace -: the trace is written to a file" in r.stderr and not os.path.exists(os.path.join(here, "-")),
       "--trace - is refused, no file named -", r)

r = loom(exe, "profile", *RUN, "--steps", "0", "--trace", os.path.join(work, "zero.json"), check=False)
expect(r.returncode != 0 and "--steps must be in 1..1000 (" in r.stderr, "--steps 0 is refused", r)
# Where the default trace cannot be written, the message named a --trace the user never gave.
if os.path.isdir("/proc"):
    r = loom(exe, "profile", *RUN, "--steps", "1", "--warmup", "0", cwd="/proc", check=False)
    expect(r.returncode != 0 and re.search(r"the trace loom-profile-[0-9-]+\.json \(here\) cannot be written \(", r.stderr)
           and "give --trace PATH" in r.stderr, "an unwritable folder for the default trace", r)
r = loom(exe, "profile", *RUN, "--trace", os.path.join(work, "no", "such", "folder", "t.json"), check=False)
expect(r.returncode != 0 and "/no/such/folder: no such folder" in r.stderr, "a trace in a missing folder is refused before training", r)
# A file where a folder is needed, some levels up: that file is named (it said "does not exist").
with open(os.path.join(work, "a_file"), "w") as f:
    f.write("x")
r = loom(exe, "profile", *RUN, "--trace", os.path.join(work, "a_file", "sub", "t.json"), check=False)
expect(r.returncode != 0 and os.path.join(work, "a_file") + " is not a folder" in r.stderr, "a trace under a file is refused, naming it", r)
# A file of the user's named <trace>.tmp stays (the profiler wrote its trace there first, and renamed it).
kept = os.path.join(work, "own.json.tmp")
with open(kept, "w") as f:
    f.write("precious")
r = loom(exe, "profile", *RUN, "--steps", "1", "--trace", os.path.join(work, "own.json"))
expect(open(kept).read() == "precious" and os.path.isfile(os.path.join(work, "own.json"))
       and not [f for f in os.listdir(work) if ".loom-" in f], "a file named like the trace's temporary one stays", r)
# A trace that cannot be written at the end (here a file made at its path while the profile ran)
# is an error, and the tables stand: they were lost with it.
late = os.path.join(work, "late.json")
p = subprocess.Popen([exe, "profile", *RUN, "--steps", "30", "--warmup", "1", "--trace", late],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
said = []
for line in p.stderr:
    said.append(line)
    if "profile   " in line:  # the profile starts: the path was checked
        with open(late, "w") as f:
            f.write("mine")
        break
out, err = p.communicate(timeout=600)
err = "".join(said) + err
expect(p.returncode == 1 and "a file of that name appeared while it ran; it is left as it is, and the trace is "
       + os.path.join(work, "late-2.json") + " instead" in err
       and "loom::step" in out and "by self time" in out and open(late).read() == "mine"
       and json.load(open(os.path.join(work, "late-2.json")))["traceEvents"],
       f"a trace whose name was taken keeps the tables, the file and the trace, under the next name (rc {p.returncode}): "
       f"{out[-400:]} {err[-600:]}")


def stop_while_the_trace_is_written(name, signals):
    """Stops a profile with `signals` SIGINTs once its trace's own file (<trace>.loom-<pid>.json, or
    its .tmp) is being written; returns (rc, stdout, stderr, the folder's files)."""
    folder = os.path.join(work, name)
    os.makedirs(folder)
    p = subprocess.Popen([exe, "profile", *RUN, "--steps", "300", "--warmup", "1", "--memory", "--trace",
                          os.path.join(folder, "t.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not [f for f in os.listdir(folder) if ".loom-" in f]:
        time.sleep(0.005)
    for _ in range(signals):
        p.send_signal(signal.SIGINT)
        time.sleep(0.2)
    out, err = p.communicate(timeout=600)
    settled = time.time() + 10  # (a stop at once removes them by an rm it starts as it ends)
    while time.time() < settled and [f for f in os.listdir(folder) if ".loom-" in f]:
        time.sleep(0.05)
    return p.returncode, out, err, sorted(os.listdir(folder))


# Under a file-size limit the trace is cut: the limit is named, not the disk ("73.6 GiB free there").
r = subprocess.run([exe, "profile", *RUN, "--steps", "20", "--warmup", "0", "--trace", os.path.join(work, "limited.json")],
                   capture_output=True, text=True,
                   preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, resource.RLIM_INFINITY)))
expect(r.returncode == 1 and "(it reached the file-size limit of this process, `ulimit -f`, 200.0 KiB: raise it" in r.stderr
       and not [f for f in os.listdir(work) if f.startswith("limited")], "a trace cut by `ulimit -f` names the limit", r)

# Stopped at once while its trace was written: the partial trace (96 MB) was left behind.
rc, out, err, files = stop_while_the_trace_is_written("at_once", 2)
expect(rc in (130, -signal.SIGINT) and not [f for f in files if ".loom-" in f],
       f"a stop at once in the trace's writing leaves no part of it (rc {rc}): {files} {err[-600:]}")
# One SIGINT then: the trace was finished and the command ended 0 after saying it was stopping.
rc, out, err, files = stop_while_the_trace_is_written("once", 1)
expect(rc == 130 and "loom profile: stopped by SIGINT as its trace was written, which it finished: the report above and the "
       "trace are whole" in err and files == ["t.json"] and "by self time" in out,
       f"a stop in the trace's writing keeps the profile and says it stopped (rc {rc}): {files} {err[-600:]}")
r = loom(exe, "profile", *RUN, "--trace", "/proc/nope.json", check=False)  # a folder no file can be made in
expect(r.returncode != 0 and "--trace /proc/nope.json cannot be written (" in r.stderr and "profiled" not in r.stderr,
       "an unwritable trace path is refused before training", r)
r = loom(exe, "profile", *RUN, "--trace", os.path.join(work, "t.json.gz"), check=False)  # viewers read .gz as gzip
expect(r.returncode == 1 and "Loom writes the trace as plain JSON; name it " + os.path.join(work, "t.json") in r.stderr,
       "a .gz trace name is refused", r)
# Steps replayed after an out-of-memory are in the tables with their failed attempts: said.
r = loom(exe, "profile", "-c", os.path.join(source, "configs", "debug.ini"), "--steps", "3", "--warmup", "0",
         "--device-memory-limit", "400KiB", "--set", "memory.policies=oom_recovery", "--trace", os.path.join(work, "oom.json"))
expect("ran out of memory" in r.stdout and "were replayed with a smaller micro-batch: the calls and times above hold the "
       "failed attempts too" in r.stdout, "a profile with replayed steps says so", r)
# Ctrl-C in `loom bench` after a round: the rounds that finished are reported, not thrown away.
benched = os.path.join(work, "benched.ini")
with open(benched, "w") as f:
    f.write("[data]\nname = synthetic\n")
p = subprocess.Popen([exe, "bench", "configs", benched, "--steps", "3", "--repeats", "50", *RUN],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
said = []
for line in p.stderr:
    said.append(line)
    if "round 2 of 50" in line:
        p.send_signal(signal.SIGINT)
        break
out, err = p.communicate(timeout=600)
err = "".join(said) + err
stopped = re.search(r"loom bench: stopped by SIGINT in round (\d+) of 50: the table holds the (\d+) rounds? that finished", err)
expect(p.returncode == 130 and stopped and int(stopped.group(2)) == int(stopped.group(1)) - 1 >= 1 and "samples/s" in out
       and ("one round, the only one finished" in out) == (stopped.group(2) == "1"),
       f"a stopped bench reports its finished rounds (rc {p.returncode}): {out[-400:]} {err[-600:]}")

# A bench killed at once (SIGKILL: no clean-up) left its scratch folder in TMPDIR for good; the
# next bench or profile removes it (its owner file names a process that has ended), and no other.
scratch_tmp = os.path.join(work, "tmp")
os.makedirs(os.path.join(scratch_tmp, "loom-bench-mine"))  # (not Loom's: no owner file)
env = dict(os.environ, TMPDIR=scratch_tmp)
p = subprocess.Popen([exe, "bench", "configs", benched, "--steps", "500", "--repeats", "50", *RUN], env=env,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.time() + 120
while time.time() < deadline and len(os.listdir(scratch_tmp)) < 2:
    time.sleep(0.1)
left = sorted(set(os.listdir(scratch_tmp)) - {"loom-bench-mine"})
time.sleep(0.5)  # (its owner file written)
p.kill()
p.wait()
r = loom(exe, "bench", "configs", benched, "--steps", "2", *RUN, env=env)
expect(len(left) == 1 and sorted(os.listdir(scratch_tmp)) == ["loom-bench-mine"],
       f"a killed bench's scratch folder is removed by the next ({left} -> {os.listdir(scratch_tmp)})", r)

# bench/gpu_kernels.py's idle time between a CUDA trace's kernels (a CPU trace has none): on a
# known timeline, the busiest stream's gaps by length, a kernel overlapped by a longer one adding
# no gap, and the copy stream's kernels left out.
sys.path.insert(0, os.path.join(source, "bench"))
import gpu_kernels  # noqa: E402  (bench/ on the path first)

def kernel(ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream}}

timeline = [kernel(0, 100), kernel(103, 50), kernel(160, 500), kernel(200, 100),  # gaps 3, 7; (200, 100) inside
            kernel(700, 40), kernel(2000, 10), kernel(5, 300, stream=9)]         # gaps 40, 1260; stream 9: less time
stream, busy, sums, counts = gpu_kernels.stream_gaps(timeline)
expect((stream, busy) == (7, 800), f"the busiest stream and its kernel time (got {stream}, {busy})")
expect(sums == [10, 40, 1260] and counts == [2, 1, 1], f"gaps by class (got {sums}, {counts})")
expect(gpu_kernels.stream_gaps([{"ph": "X", "cat": "gpu_memcpy", "ts": 0, "dur": 5}]) is None, "no kernels, no gaps")
print("ok")
