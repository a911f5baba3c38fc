"""parallel = ddp on the CPU over loopback (Gloo): two processes train as one process with the same
global batch does; launched by `loom launch`, by torchrun and as two "nodes"; a rank that dies
stops the other with an error naming it; a job killed with SIGKILL resumes with another world
size and goes on as the run that never stopped."""
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from common import SMALL, close, loom, losses, metrics, workdir

exe = sys.argv[1]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
BASE = [*SMALL, "--set", "model.dropout=0", "--set", "trainer.threads=1", "--set", "parallel.timeout=60"]
DDP = ["--set", "parallel.name=ddp"]


_given_ports = set()


def free_port():
    # Below the kernel's ephemeral range (ip_local_port_range): a port the kernel hands out is one
    # an outgoing connection (gloo's own, another test's) may take before the rank binds it; one
    # below that range is taken only by a listener. Each port is given once per test.
    low = 32768
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid())
    for _ in range(200 if low - 1024 >= 2000 else 0):  # (a range that starts low: the kernel's choice)
        port = rng.randrange(max(1025, low - 12000), low)
        if port in _given_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given_ports.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, timeout=600, check=True, env=None):
    r = subprocess.run([exe, "launch", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        print(r.stdout, r.stderr, sep="\n")
        raise SystemExit(f"loom launch {' '.join(args)} failed with {r.returncode}")
    return r


def weights(run):
    from safetensors.numpy import load_file
    step = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))[-1]
    return load_file(os.path.join(run, "checkpoints", step, "model.safetensors"))


def launched_rank(launcher, rank):
    """The pid of rank `rank` among the processes `loom launch` (the Popen `launcher`) started."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    found = [c for c in children
             if f"RANK={rank}" in open(f"/proc/{c}/environ", "rb").read().decode(errors="replace").split("\0")]
    assert found, f"no rank {rank} among {children}"
    return int(found[0])


def wait_for_training(run, proc, what):
    """Until `run` has logged a step (its metrics.jsonl is not empty), while `proc` runs."""
    jsonl = os.path.join(work, run, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(jsonl) and os.path.getsize(jsonl) > 0):
        assert time.time() < deadline and proc.poll() is None, f"{what} did not start training"
        time.sleep(0.05)


work = workdir()
try:
    args = [*BASE, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=20"]

    # 1. Two ranks of 16 equal one process of 32: losses and weights (and every rank holds rank 0's).
    loom(exe, "train", *args, "--set", "trainer.name=single")
    r = launch("--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "trainer.name=ddp")
    assert "batch 32 = 16 x 1 x 2" in r.stderr, r.stderr
    assert "weights identical on all 2 ranks" in r.stderr, r.stderr
    single = losses(os.path.join(work, "single"))
    close(losses(os.path.join(work, "ddp")), single, "ddp x 2 against single")
    # Weights within 1e-5 of single's, except where single differs from itself as much: AdamW
    # divides by the root of the squared gradients, so a parameter whose true gradient is zero
    # (the key part of an attention's qkv bias: softmax ignores a constant added to every key)
    # moves by rounding noise, about lr per step, however the sums are ordered. The same single
    # run on 2 threads instead of 1 measures that noise.
    loom(exe, "train", *args, "--set", "trainer.name=single_2t", "--set", "trainer.threads=2")
    ws, wd, wt = (weights(os.path.join(work, n)) for n in ("single", "ddp", "single_2t"))
    assert sorted(ws) == sorted(wd)
    worst = 0.0
    for k in ws:
        diff, noise = float(abs(ws[k] - wd[k]).max()), float(abs(ws[k] - wt[k]).max())
        assert diff <= max(1e-5, 4 * noise), f"{k}: ddp differs from single by {diff} (single 1 vs 2 threads: {noise})"
        worst = max(worst, diff) if noise <= 1e-5 else worst
    print(f"ddp x 2 = single over 20 steps (weights within {worst:.1e} where single agrees with itself); ranks identical")

    # 1-. A model of more than 64 MiB: the end's comparison with rank 0 takes a part of it at a
    # time (two host copies of the whole model per rank could end a finished run out of memory),
    # and compares every tensor.
    r = launch("--nproc-per-node", "2", "--", "train", *BASE, "--set", f"trainer.work_dir={work}", *DDP,
               "--set", "trainer.max_steps=1", "--set", "model.flavour=standard", "--set", "model.d_model=1024",
               "--set", "model.num_layers=2", "--set", "trainer.callbacks=checkpoint", "--set", "trainer.name=ddp_large")
    parts = re.search(r"weights identical on all 2 ranks at the end \((\d+) tensors compared with rank 0's, in (\d+) parts\)",
                      r.stderr)
    assert parts and int(parts.group(1)) == len(weights(os.path.join(work, "ddp_large"))) and int(parts.group(2)) >= 2, \
        r.stderr[-2000:]
    print(f"a model of more than 64 MiB: {parts.group(1)} tensors compared with rank 0's in {parts.group(2)} parts")

    # 1a. The gradients in many small buckets, reduced while backward runs, and in one reduction
    # after backward: the same run.
    r = launch("--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "parallel.bucket_mb=0.002",
               "--set", "trainer.name=ddp_buckets")
    assert "started during backward" in r.stderr and "gradients in 1 bucket" not in r.stderr, r.stderr[-2000:]
    close(losses(os.path.join(work, "ddp_buckets")), single, "ddp with 2 KiB buckets")
    launch("--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "parallel.bucket_mb=0",
           "--set", "trainer.name=ddp_after")
    close(losses(os.path.join(work, "ddp_after")), single, "ddp reducing after backward")
    print("ddp with small buckets (overlapped) and with one reduction after backward = single")

    # 1b. A warning every rank gives word for word (the configuration's) is shown once, and counted.
    r = launch("--nproc-per-node", "2", "--", "train", *BASE, "--set", f"trainer.work_dir={work}", *DDP,
               "--set", "trainer.max_steps=2", "--set", f"trainer.threads={(os.cpu_count() or 1) + 1}",
               "--set", "trainer.name=ddp_warned")
    said = [line for line in r.stderr.splitlines() if "logical cores: threads beyond the cores" in line]
    assert len(said) == 1 and "launch: 1 warning that another rank gave first, word for word, shown once" in r.stderr, \
        r.stderr[-3000:]
    print("a warning both ranks give is shown once")

    # 1c. NCCL reduces CUDA tensors: asked for on CPU ranks, one error on each, naming the key.
    r = launch("--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "parallel.backend=nccl",
               "--set", "trainer.name=nccl_on_cpu", check=False, timeout=120)
    assert r.returncode != 0 and "parallel.backend = nccl" in r.stderr, r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "Segmentation" not in r.stderr, r.stderr[-2000:]
    print("parallel.backend = nccl on CPU ranks: refused, naming the key")

    # 1b. Out of memory on rank 1 alone (a budget on that rank only): both ranks re-plan to
    # 8 x 2 and replay the step, and the run stays the single run's.
    port = str(free_port())
    oom = [*args, *DDP, "--set", "memory.policies=oom_recovery", "--set", "trainer.name=ddp_oom"]
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    ranks = [subprocess.Popen([exe, "train", *oom, *(["--device-memory-limit", "400KiB"] if r == 1 else [])],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), outs
    assert "32 = 16 x 1 x 2 -> 8 x 2 x 2 after running out of memory at step 1" in outs[0][1], outs[0][1]
    assert "weights identical on all 2 ranks" in outs[0][1], outs[0][1]
    close(losses(os.path.join(work, "ddp_oom")), single, "ddp with an out-of-memory on rank 1")
    print("out of memory on rank 1 only: both ranks re-planned to 8 x 2 x 2 and the run = single")
    # ... resumed as it was started: each rank decides by its own device whether to start at the
    # checkpoint's re-plan (rank 0's, which wrote it), and the ranks agree on the smallest; no step
    # runs out of memory again. (The agreement inside the checkpoint's load met rank 1's broadcast:
    # every ddp resume hung.)
    env = dict(env, MASTER_PORT=str(free_port()))
    more = ["--set", "trainer.max_steps=24", "--resume", "auto"]
    ranks = [subprocess.Popen([exe, "train", *oom, *more, *(["--device-memory-limit", "400KiB"] if r == 1 else [])],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), outs
    assert "resumed from" in outs[0][1] and "-> micro-batch 8 x accumulation 2 x 2 devices = 32: the run ran out of memory at a larger " \
        "micro-batch on this device and configuration before" in outs[0][1], outs[0][1]
    assert "after running out of memory" not in outs[0][1] + outs[1][1], outs
    print("resumed: rank 0 starts at the checkpoint's re-plan, rank 1 agrees, no out-of-memory again")
    # ... resumed by a rank whose node lacks the run folder (another work_dir): its settings are the
    # defaults, rank 0's the run's; the error says why (it was a 1 KB list of differing keys).
    env = dict(env, MASTER_PORT=str(free_port()))
    elsewhere = os.path.join(work, "elsewhere")
    os.makedirs(elsewhere)
    ranks = [subprocess.Popen([exe, "train", "--set", f"trainer.work_dir={work if r == 0 else elsewhere}", *DDP,
                               "--set", "trainer.name=ddp_oom", "--set", "trainer.max_steps=30", "--resume", "auto"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in ranks]
    assert all(p.returncode == 1 for p in ranks), outs
    assert f"this rank's --resume auto found no run to take its settings from in trainer.work_dir = {elsewhere}" \
        in outs[1][1], outs[1][1][-3000:]
    assert not os.listdir(elsewhere) and "step_00000030" not in os.listdir(os.path.join(work, "ddp_oom", "checkpoints")), outs
    print("a rank without the run folder: said so, nothing written")

    # 2. With accumulation: 8 x 2 micro-batches on each of 2 ranks, against 16 x 2 in one process.
    acc = ["--set", "trainer.gradient_accumulation_steps=2"]
    loom(exe, "train", *args, *acc, "--set", "trainer.name=single_acc")
    r = launch("--nproc-per-node", "2", "--", "train", *args, *acc, *DDP, "--set", "trainer.name=ddp_acc")
    assert "batch 32 = 8 x 2 x 2" in r.stderr, r.stderr
    close(losses(os.path.join(work, "ddp_acc")), losses(os.path.join(work, "single_acc")), "ddp with accumulation")
    print("ddp x 2 with accumulation = single with accumulation")

    # 3. Started by torchrun (its elastic agent hosts the store) instead of loom launch.
    if os.path.exists(torchrun):
        t = subprocess.run([torchrun, "--no-python", "--nproc-per-node", "2", "--master-port", str(free_port()), exe,
                            "train", *args, *DDP, "--set", "trainer.name=torchrun"],
                           capture_output=True, text=True, timeout=600)
        if t.returncode != 0:
            print(t.stdout, t.stderr, sep="\n")
            raise SystemExit(f"torchrun failed with {t.returncode}")
        close(losses(os.path.join(work, "torchrun")), single, "ddp under torchrun")
        print("ddp x 2 under torchrun --no-python = single")
    else:
        print(f"(no {torchrun}: the torchrun case is left out)")

    # 4. Two "nodes" of one process each, on loopback.
    port = str(free_port())
    nodes = [subprocess.Popen([exe, "launch", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--master-port", port, "--", "train", *args, *DDP, "--set", "trainer.name=nodes"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in nodes]
    for n, p in enumerate(nodes):
        assert p.returncode == 0, f"node {n}: {outs[n][1]}"
    close(losses(os.path.join(work, "nodes")), single, "two nodes")
    print("two nodes of one rank each = single")
    # Nodes started with different configurations (a model option: Gloo aborted rank 0 in the first
    # broadcast of a shape that differed) are refused at the start, the keys named; threads may differ.
    port = str(free_port())
    nodes = [subprocess.Popen([exe, "launch", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--master-port", port, "--", "train", *args, *DDP, "--set", "trainer.name=nodes_differ",
                               "--set", f"trainer.threads={n + 1}", *(["--set", "model.dropout=0.2", "--set",
                                                                       "trainer.lr=0.01"] if n else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], [o[1][-2000:] for o in outs]
    said = outs[1][1]
    assert "rank 1's configuration differs from rank 0's: " in said and "dropout = 0.2 (--set) on rank 1, 0 on rank 0" in said \
        and "trainer.lr = 0.01 (--set) on rank 1, " in said, said[-2000:]
    # A --resume-from that names nothing, said before the data is read: rank 0 looks, and rank 1,
    # on a node no launcher of rank 0's stops, says it too (it waited for parallel.timeout).
    port = str(free_port())
    typo = os.path.join(work, "typo-run")
    nodes = [subprocess.Popen([exe, "launch", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--master-port", port, "--", "train", *args, *DDP, "--set", "trainer.name=typo",
                               "--set", f"trainer.resume_from={typo}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    try:
        typo_outs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [1, 1], [o[1][-2000:] for o in typo_outs]
    for out in typo_outs:
        assert f"trainer.resume_from = {typo}: no such checkpoint" in out[1], out[1][-2000:]
    # Node 0, whose log may be all a multi-node job's user reads, names the first key that differs too.
    assert "1 rank's configuration differs from rank 0's; rank 1's first difference: " in outs[0][1] \
        and "dropout = 0.2 (--set) on rank 1, 0 on rank 0 (its own error names every key)" in outs[0][1], outs[0][1][-2000:]
    assert "Aborted" not in outs[0][1] + outs[1][1]
    assert "threads" not in said.split("differs from rank 0's: ")[1].split(". Every rank")[0], said[-2000:]
    print("nodes started with different configurations: refused at the start, the keys named")
    # Nodes whose data differ where the configuration may (a path: another copy of Fashion-MNIST,
    # of 600 training images): refused at the start, the split's sizes named. It sharded with
    # overlaps, unsaid (and a model of another plugin version waited parallel.timeout in the
    # weights' broadcast, each rank blaming the other as gone).
    import gzip
    fm = "/usr/share/datasets/fashion-mnist"
    small = os.path.join(work, "fm_small")
    os.makedirs(small)
    with gzip.open(os.path.join(fm, "train-images-idx3-ubyte.gz")) as f:
        images = f.read(16 + 600 * 784)
    with gzip.open(os.path.join(fm, "train-labels-idx1-ubyte.gz")) as f:
        labels = f.read(8 + 600)
    with open(os.path.join(small, "train-images-idx3-ubyte"), "wb") as f:
        f.write(images[:4] + (600).to_bytes(4, "big") + images[8:])
    with open(os.path.join(small, "train-labels-idx1-ubyte"), "wb") as f:
        f.write(labels[:4] + (600).to_bytes(4, "big") + labels[8:])
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        os.symlink(os.path.join(fm, name), os.path.join(small, name))
    port = str(free_port())
    started = time.time()
    nodes = [subprocess.Popen([exe, "launch", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--master-port", port, "--", "train", *BASE, *DDP, "--set", "data.name=fashion_mnist",
                               "--set", f"trainer.work_dir={work}", "--set", "trainer.name=data_differ",
                               *(["--set", f"data.path={small}"] if n else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], [o[1][-2000:] for o in outs]
    assert "rank 1's model or data differs from rank 0's: samples in the dataset's train split 600 on rank 1, 60000 on " \
           "rank 0" in outs[1][1], outs[1][1][-2000:]
    assert "1 rank's model or data differs from rank 0's; rank 1's first difference: samples in the dataset's train " \
           "split 600 on rank 1" in outs[0][1], outs[0][1][-2000:]
    assert time.time() - started < 120, "refused at the start, not after parallel.timeout"
    print("nodes with other data at a path: refused at the start, the split's sizes named")
    # ... and of the same size, one label changed on node 1's copy: the split's fingerprint differs.
    relabelled = os.path.join(work, "fm_relabelled")
    os.makedirs(relabelled)
    with gzip.open(os.path.join(fm, "train-labels-idx1-ubyte.gz")) as f:
        labels = bytearray(f.read())
    labels[8] = (labels[8] + 1) % 10
    with open(os.path.join(relabelled, "train-labels-idx1-ubyte"), "wb") as f:
        f.write(labels)
    for name in ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        os.symlink(os.path.join(fm, name), os.path.join(relabelled, name))
    port = str(free_port())
    nodes = [subprocess.Popen([exe, "launch", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--master-port", port, "--", "train", *BASE, *DDP, "--set", "data.name=fashion_mnist",
                               "--set", f"trainer.work_dir={work}", "--set", "trainer.name=labels_differ",
                               *(["--set", f"data.path={relabelled}"] if n else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], [o[1][-2000:] for o in outs]
    assert re.search(r"rank 1's model or data differs from rank 0's: the dataset's train split\.fingerprint \S+ on rank 1, "
                     r"\S+ on rank 0", outs[1][1]), outs[1][1][-2000:]
    assert not os.path.exists(os.path.join(work, "labels_differ", "checkpoints")), "refused before the run folder"
    print("nodes with one label changed in a copy of the same size: refused at the start, the split's fingerprint named")
    # Nodes started for different worlds (--nnodes 2 and 3 by mistake): rank 0 waited in Gloo's
    # connection of every pair, with no deadline; each now says at once how its world differs.
    # Either way round: node 0 counting more ranks than come waited for them in the store.
    for worlds in ((2, 3), (3, 2)):
        port = str(free_port())
        nodes = [subprocess.Popen([exe, "launch", "--nnodes", str(worlds[n]), "--node-rank", str(n), "--nproc-per-node",
                                   "1", "--master-port", port, "--", "train", *args, *DDP, "--set",
                                   f"trainer.name=worlds_differ{worlds[0]}", "--set", "trainer.batch_size=12"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
        started = time.monotonic()
        outs = [p.communicate(timeout=300) for p in nodes]
        assert [p.returncode for p in nodes] == [1, 1], [o[1][-2000:] for o in outs]
        assert time.monotonic() - started < 50, "the ranks waited for parallel.timeout (60 s)"
        for out in outs:
            assert f"rank 1 was started as one of {worlds[1]} ranks, rank 0 as one of {worlds[0]}: start every node with " \
                "the same --nnodes and --nproc-per-node" in out[1], out[1][-2000:]
    print("nodes started for different worlds: refused at once, on both, either way round")
    # One world split two ways (2 x 2 on node 0, 4 x 1 on node 1 as its rank 1): two processes of
    # rank 1, and no rank 2 or 3; both waited for parallel.timeout, then blamed a rank that never failed.
    port = str(free_port())
    nodes = [subprocess.Popen([exe, "launch", "--nnodes", str(nnodes), "--node-rank", str(n), "--nproc-per-node",
                               str(nproc), "--master-port", port, "--", "train", *args, *DDP, "--set",
                               "trainer.name=split_differ", "--set", "trainer.batch_size=12"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, nnodes, nproc in ((0, 2, 2), (1, 4, 1))]
    started = time.monotonic()
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], [o[1][-2000:] for o in outs]
    assert time.monotonic() - started < 50, "the ranks waited for parallel.timeout (60 s)"
    assert "rank 1 of 4 was started twice" in outs[0][1], outs[0][1][-2000:]  # (said by rank 0, whichever rank 1 was refused)
    print("one world split two ways: refused at once, the duplicate rank named")
    r = launch("--nproc-per-node", "3", "--", "train", *args, *DDP, "--set", "trainer.name=uneven", check=False)
    assert r.returncode == 1 and r.stderr.count("is not divisible by trainer.gradient_accumulation_steps 1 x world size 3") == 1 \
        and " rank 0]" not in r.stderr, r.stderr[-2000:]  # (said once, by the launcher, before any rank starts)
    # A resume keeps its run's batch: the fix offered is the number of ranks (it offered a batch of 30).
    r = launch("--nproc-per-node", "3", "--", "train", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ddp",
               *DDP, "--resume", "auto", check=False)
    assert r.returncode == 1 and "(the run's config.json) is not divisible" in r.stderr \
        and "this resume keeps the run's batch, so launch it with --nproc-per-node 1, 2, 4, 8" in r.stderr, r.stderr[-2000:]
    # A strategy of one process under loom launch: refused once, by the launcher, before any rank starts.
    r = launch("--nproc-per-node", "2", "--", "train", *args, "--set", "trainer.name=alone", check=False)
    assert r.returncode == 1 and r.stderr.count("loom launch: parallel.name = single (default) trains in one process: "
                                                "each of the 2 would train the whole model by itself") == 1 \
        and " rank 0]" not in r.stderr and " rank 1]" not in r.stderr, r.stderr[-2000:]
    # Started by hand as ranks of a job (torchrun's variables), each rank refuses itself.
    port = str(free_port())
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    r = subprocess.run([exe, "train", *args, "--set", "trainer.name=alone_by_hand"], env=dict(env, RANK="1", LOCAL_RANK="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and re.search(r"this process is rank 1 of 2 \(.*\), but parallel strategy 'single' trains "
                                           r"alone", r.stderr), r.stderr[-2000:]

    # 5. A rank killed: the other stops with an error naming it, well within a minute.
    long = [*BASE, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=100000", "--set",
            "parallel.timeout=30", *DDP, "--set", "trainer.name=killed_rank"]
    port = str(free_port())
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    ranks = [subprocess.Popen([exe, "train", *long], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    wait_for_training("killed_rank", ranks[0], "rank 0")
    ranks[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    _, err = ranks[0].communicate(timeout=90)
    waited = time.time() - killed_at
    ranks[1].communicate()
    assert ranks[0].returncode != 0, "rank 0 went on without rank 1"
    assert "rank 1 stopped (its connection closed)" in err, err[-2000:]
    assert waited <= 60, f"rank 0 took {waited:.0f} s to stop"
    print(f"rank 1 killed: rank 0 stopped {waited:.1f} s later naming it")
    # ... as a Ctrl-C reaches rank 0: its stop line promised a checkpoint, which it cannot agree on
    # with rank 1; the error says none of the stop was written (it named the older ones alone).
    port = str(free_port())
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    ranks = [subprocess.Popen([exe, "train", *long[:-1], "trainer.name=killed_stop", "--set", "trainer.checkpoint_every=5"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    run = os.path.join(work, "killed_stop")
    deadline = time.time() + 120
    while not os.path.isdir(os.path.join(run, "checkpoints", "step_00000005")):
        assert time.time() < deadline and ranks[0].poll() is None, "killed_stop wrote no checkpoint"
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGKILL)
    ranks[0].send_signal(signal.SIGINT)
    _, err = ranks[0].communicate(timeout=90)
    ranks[1].communicate()
    newest = max(int(d[len("step_"):]) for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
    trained = max(m["step"] for m in metrics(run, partial=True))
    assert ranks[0].returncode == 1 and "stopping after the current step, with a checkpoint" in err, err[-2000:]
    if newest < trained:  # (else the stop's step was a checkpoint's, one time in five)
        # (the step rank 0 names is its own count: metrics.jsonl, read after, may lag it by the
        # step whose log line the failure cut; it failed the test once in a loaded run)
        said = re.search(r"no checkpoint of the stop was written \(step (\d+) was the last trained\); the run's checkpoints "
                         r"up to (\S+) are intact", err)
        assert said and int(said.group(1)) >= trained > newest \
            and said.group(2) == os.path.join(run, "checkpoints", f"step_{newest:08d}"), err[-2000:]
    print(f"rank 1 killed as rank 0 stops: its checkpoints up to step {newest} named, the stop's (after {trained}) said not written")

    # ... and under loom launch, which names the rank and stops the rest.
    p = subprocess.Popen([exe, "launch", "--nproc-per-node", "2", "--", "train", *long[:-1], "trainer.name=killed_launch"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_training("killed_launch", p, "the launched job")
    os.kill(launched_rank(p, 1), signal.SIGSEGV)  # (a crash: a real one takes the same handler)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and "launch: rank 1 was killed by signal 11" in err, err[-2000:]
    # the rank's crash line, not the last of the stack after it ("loom(+0x87f71)[0x5556...]")
    assert re.search(r"Its error: \S*loom: killed by SIGSEGV, which process \d+ sent \(kill\): no fault of its own", err), err[-2000:]
    print("loom launch: rank 1 crashed -> the job stopped, the launcher named rank 1 and quoted its crash")
    # ... in a validation: the step trained on both ranks, only its evaluation is lost; rank 0
    # keeps the step (its evaluation pending, which the resume runs first), where the steps since
    # the last checkpoint were lost with the job.
    metric = os.path.join(os.path.dirname(exe), "..", "tests", "models", "libloom_model_metric_model.so")
    assert os.path.exists(metric), f"{metric} is built with the tests (tests/plugins)"
    killed_eval = ["--set", "model.name=metric_model", "--set", "data.name=synthetic", "--set", "data.train_size=512",
                   "--set", "data.test_size=64", "--set", "trainer.batch_size=32", "--set", "trainer.device=cpu",
                   "--set", "precision.name=fp32", "--set", "trainer.threads=1", "--set", "parallel.timeout=30",
                   "--set", "memory.estimate=false", *DDP,
                   "--set", f"trainer.work_dir={work}", "--set", "trainer.name=killed_in_eval", "--set", "trainer.max_steps=12",
                   "--set", "trainer.eval_every=3", "--set", "trainer.checkpoint_every=100"]
    r = launch("--plugin-dir", metric, "--nproc-per-node", "2", "--", "train", *killed_eval, timeout=300, check=False,
               env=dict(os.environ, LOOM_TEST_EVAL_KILL_RANK="1"))
    saved = os.path.join(work, "killed_in_eval", "checkpoints", "step_00000003")
    assert r.returncode != 0 and "launch: rank 1 was killed by signal 9" in r.stderr, r.stderr[-2500:]
    assert "evaluation at step 3 failed (below); the step's checkpoint is saved, its evaluation pending" in r.stderr, \
        r.stderr[-2500:]
    assert '"evaluation_pending": true' in open(os.path.join(saved, "state.json")).read(), os.listdir(saved)
    r = launch("--plugin-dir", metric, "--nproc-per-node", "2", "--", "train", *killed_eval, "--set", "trainer.resume=auto",
               timeout=300)
    assert "the evaluation of step 3 that a stop or a failure cut short runs first" in r.stderr, r.stderr[-2500:]
    assert "done" in r.stderr and os.path.isdir(os.path.join(work, "killed_in_eval", "checkpoints", "step_00000012")), \
        r.stderr[-2500:]
    print("rank 1 killed in step 3's validation: rank 0 kept step 3, its evaluation pending; the resume ran it first")

    # 5b. Ctrl-C of a launched job: passed on to every rank, which stop after the same step,
    # rank 0 writing its checkpoint, however long that takes (--grace, the deadline after a rank
    # failed, does not apply: 0 here would kill them at once); the launcher exits 130.
    p = subprocess.Popen([exe, "launch", "--nproc-per-node", "2", "--grace", "0", "--", "train", *long[:-1],
                          "trainer.name=interrupted"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_training("interrupted", p, "the launched job")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    stops = sorted({l.split("after step ")[1].split()[0] for l in err.splitlines() if "stopped by SIGINT after step" in l})
    assert p.returncode == 130 and len(stops) == 1, (p.returncode, err[-2000:])
    # (both ranks said it, word for word: the launcher shows it once and counts the other)
    assert err.count("stopped by SIGINT") == 1 and "launch: 1 warning that another rank gave first" in err, err[-2000:]
    assert os.path.isdir(os.path.join(work, "interrupted", "checkpoints", f"step_{int(stops[0]):08d}")), err[-2000:]
    print(f"Ctrl-C of a launched job: both ranks stopped after step {stops[0]}, its checkpoint written")
    # A rank killed from outside as the ranks stop on a Ctrl-C: no clean stop (rank 0's stop may
    # have written no checkpoint), so exit 1 naming the killed rank, not 130.
    p = subprocess.Popen([exe, "launch", "--nproc-per-node", "2", "--", "train", *long[:-1], "trainer.name=interrupted_kill"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_training("interrupted_kill", p, "the launched job")
    os.kill(launched_rank(p, 1), signal.SIGKILL)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "launch: rank 1 was killed by signal 9" in err, (p.returncode, err[-2000:])
    print("a rank killed as a Ctrl-C stops the job: exit 1, the launcher named it")

    def stopped_gracefully(name):
        """The step a run stopped after, where it stopped as the first signal promises: with the
        checkpoint of its last logged step (a stop at once leaves none: the next is steps away)."""
        last = max(losses(os.path.join(work, name)))
        saved = [int(d[5:]) for d in os.listdir(os.path.join(work, name, "checkpoints")) if d.startswith("step_")]
        assert last in saved, f"{name}: stopped at once after step {last}, its checkpoints {sorted(saved)}"
        return last

    # (steps of 65536: a stop takes long enough for a second signal to land in it)
    slow = [{"trainer.batch_size=32": "trainer.batch_size=65536", "data.train_size=2048": "data.train_size=262144"}.get(a, a)
            for a in long[:-1]]
    # A rank that handles no signal (stopped: a debugger, an uninterruptible wait): the launcher
    # waited for ever, whatever it was sent. A third signal kills what still runs.
    p = subprocess.Popen([exe, "launch", "--nproc-per-node", "2", "--", "train", *long[:-1], "trainer.name=frozen_rank"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_training("frozen_rank", p, "the launched job")
    frozen = launched_rank(p, 1)
    os.kill(frozen, signal.SIGSTOP)
    for _ in range(3):
        p.send_signal(signal.SIGINT)
        time.sleep(1)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(frozen, signal.SIGCONT)
        p.kill()
        raise SystemExit("a rank stopped with SIGSTOP: the launcher still waited 60 s after a third SIGINT")
    assert p.returncode == 130 and "launch: a third SIGINT: the ranks still running are killed (SIGKILL)" in err, \
        (p.returncode, err[-2000:])
    print("a rank that handles no signal (SIGSTOP): a third SIGINT kills it, the launcher exits 130")
    # `timeout -s INT` signals the launcher, then its process group, the launcher again, a moment
    # apart: one stop (passed on twice, the second copy stopped the ranks at once, no checkpoint,
    # and the launcher still exited 130).
    p = subprocess.Popen([exe, "launch", "--nproc-per-node", "2", "--", "train", *slow, "trainer.name=timeout_int"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_training("timeout_int", p, "the launched job")
    p.send_signal(signal.SIGINT)
    time.sleep(0.1)  # (handled by then: the kernel would merge two pending copies into one)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "stopped at once" not in err, (p.returncode, err[-2000:])
    print(f"SIGINT twice 0.1 s apart (as timeout -s INT sends it): one stop, after step {stopped_gracefully('timeout_int')}")
    # 5b'. `loom launch ... | tee log`, and a Ctrl-C kills tee too: the launcher, its standard error
    # closed, goes on watching its ranks (it died of SIGPIPE, and the SIGTERM its death sent the
    # ranks after the SIGINT was a second signal: they stopped at once, no checkpoint).
    p = subprocess.Popen([exe, "launch", "--nproc-per-node", "2", "--", "train", *slow, "trainer.name=tee_died"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_training("tee_died", p, "the launched job")
    p.stderr.close()
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=120) == 130, p.returncode
    print(f"Ctrl-C with the launcher's stderr closed: exit 130, stopped after step {stopped_gracefully('tee_died')}")
    # ... and a launcher killed outright after it passed a Ctrl-C on: its ranks still stop as the
    # Ctrl-C asked (its death reaches them as SIGHUP, the graceful stop, not as a second signal).
    p = subprocess.Popen([exe, "launch", "--nproc-per-node", "2", "--", "train", *slow, "trainer.name=launcher_killed"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_training("launcher_killed", p, "the launched job")
    ranks = [launched_rank(p, r) for r in (0, 1)]
    p.send_signal(signal.SIGINT)
    for line in p.stderr:  # (passed on: rank 0 says so, in its step of 65536, long before its end)
        if "stopping after the current step" in line:
            break
    p.kill()
    p.wait()
    deadline = time.time() + 120
    for pid in ranks:
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            assert time.time() < deadline, "a rank of the killed launcher went on"
            time.sleep(0.05)
    print(f"launcher killed after a Ctrl-C: its ranks stopped after step {stopped_gracefully('launcher_killed')}")
    # A launcher started with SIGCHLD ignored (a daemon's or a job runner's setting, which survives
    # exec: the kernel reaped the ranks and the launcher waited for them for ever) and under another
    # launcher's variables (loom launch inside a torchrun job: each rank took TORCHELASTIC_* for its own).
    r = subprocess.run([exe, "launch", "--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "trainer.name=foreign"],
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN),
                       env=dict(os.environ, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="job", ROLE_RANK="0"))
    assert r.returncode == 0 and "weights identical on all 2 ranks" in r.stderr, r.stderr[-2000:]
    print("loom launch with SIGCHLD ignored and torchrun's variables set: the job ran and ended")

    # 5c. A signal that reaches one rank only (a scheduler signalling one process): every rank stops
    # after the same step and names that signal, not a guessed one.
    port = str(free_port())
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    ranks = [subprocess.Popen([exe, "train", *long[:-1], "trainer.name=one_rank_signalled"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    wait_for_training("one_rank_signalled", ranks[0], "rank 0")
    ranks[1].send_signal(signal.SIGINT)
    errs = [rank.communicate(timeout=120)[1] for rank in ranks]
    stops = [[l.split("after step ")[1].split()[0] for l in e.splitlines() if "stopped by SIGINT after step" in l]
             for e in errs]
    assert all(len(s) == 1 for s in stops) and stops[0] == stops[1], (stops, errs[0][-1500:], errs[1][-1500:])
    assert "SIGTERM" not in errs[0], errs[0][-1500:]
    print(f"SIGINT to rank 1 alone: both ranks stopped after step {stops[0][0]}, both naming SIGINT")

    # 5c'. A callback that stops rank 0 alone, during a step that is not due for evaluation: every
    # rank stops after that step (their evaluations would not meet otherwise) and ends cleanly.
    record = os.path.join(os.path.dirname(exe), "..", "tests", "models", "libloom_callback_record_callback.so")
    assert os.path.exists(record), f"{record} is built with the tests (tests/plugins)"
    for hook in ("on_step_begin", "on_log"):
        name = f"one_rank_stops_{hook}"
        r = launch("--nproc-per-node", "2", "--", "train", *long[:-1], f"trainer.name={name}", "--plugin-dir", record,
                   "--set", "trainer.callbacks=record, checkpoint", "--set", "callback.record.stop_main_at=3",
                   "--set", f"callback.record.stop_main_in={hook}", "--set", "trainer.eval_every=1000",
                   "--set", "data.validation_fraction=0.5", timeout=300, check=False)
        assert r.returncode == 0, (hook, r.returncode, r.stderr[-2500:])
        assert f"record asked rank 0 alone to stop in {hook} of step 3" in r.stderr, r.stderr[-2500:]
        assert "validation step 3: " in r.stderr and "stopped   early at step 3 of 100000" in r.stderr, r.stderr[-2500:]
        assert os.path.isdir(os.path.join(work, name, "checkpoints", "step_00000003")), r.stderr[-2500:]
        print(f"a callback stopping rank 0 alone in {hook} of step 3: both ranks stopped after it, evaluated together")
    # ... in on_step_end of a step that is no log step (every 10th here): the steps since the last
    # log step are logged (the run's metrics ended at the log step before, steps 1 ... 3 unreported).
    r = launch("--nproc-per-node", "2", "--", "train", *long[:-1], "trainer.name=one_rank_stops_late", "--plugin-dir", record,
               "--set", "trainer.callbacks=record, checkpoint, jsonl", "--set", "callback.record.stop_main_at=3",
               "--set", "callback.record.stop_main_in=on_step_end", "--set", "trainer.eval_every=1000",
               "--set", "trainer.log_every=10", timeout=300, check=False)
    logged = sorted(losses(os.path.join(work, "one_rank_stops_late")))
    assert r.returncode == 0 and logged == [3], (r.returncode, logged, r.stderr[-2500:])
    assert os.path.isdir(os.path.join(work, "one_rank_stops_late", "checkpoints", "step_00000003")), r.stderr[-2500:]
    print("a callback stopping rank 0 alone in on_step_end of step 3 (log every 10): step 3 logged, its checkpoint written")
    # A rank that fails of itself (rank 1's callback throws): rank 0 exits first, its collective
    # finding rank 1 gone, and the launcher names rank 1 and its error, not rank 0's report of it.
    r = launch("--nproc-per-node", "2", "--", "train", *long[:-1], "trainer.name=rank1_fails", "--plugin-dir", record,
               "--set", "trainer.callbacks=record, checkpoint", "--set", "callback.record.fail_other_at=3",
               timeout=300, check=False)
    assert r.returncode == 1 and "launch: rank 1 exited with status 1" in r.stderr, r.stderr[-2500:]
    assert "record fails on a rank but the main one at step 3 as asked" in r.stderr.split("launch: rank 1")[-1], r.stderr[-2500:]
    print("a rank failing of itself under loom launch: the launcher names it and its error")
    # The run folder moved mid-run (rank 0 holds its lock and finds it gone before its next step):
    # rank 0 stops with the message naming where it went, nothing is made at the old path, and
    # rank 1 ends with it, not at parallel.timeout (30 s) in a collective rank 0 never joins.
    started = time.monotonic()
    r = launch("--nproc-per-node", "2", "--", "train", *long[:-1], "trainer.name=moved_ddp", "--plugin-dir", record,
               "--set", "trainer.callbacks=record, checkpoint", "--set", "callback.record.move_run_at=3",
               timeout=300, check=False)
    took = time.monotonic() - started
    assert r.returncode == 1 and "launch: rank 0 exited with status 1" in r.stderr, (r.returncode, r.stderr[-2500:])
    assert f"run folder {os.path.join(work, 'moved_ddp')} was moved to " in r.stderr \
        and "--resume auto --set trainer.name=moved_ddp.moved" in r.stderr, r.stderr[-2500:]
    assert not os.path.exists(os.path.join(work, "moved_ddp")), os.listdir(os.path.join(work, "moved_ddp"))
    assert took < 30, f"the ranks took {took:.0f} s to end (parallel.timeout is 30 s)"
    print(f"the run folder moved under loom launch: rank 0 named where it went, both ranks ended in {took:.1f} s")
    # Without trainer.threads, each of a node's processes takes its share of the cores.
    r = launch("--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "trainer.threads=0",
               "--set", "trainer.max_steps=2", "--set", "trainer.name=shared_cores")
    if "OMP_NUM_THREADS" not in os.environ:
        assert "per process: 2 processes of this job share this machine's" in r.stderr, r.stderr[-2500:]
    # The launcher's --log-level is the ranks' too (it quieted the launcher alone).
    r = launch("--log-level", "warn", "--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "trainer.max_steps=2",
               "--set", "trainer.name=quiet_ranks")
    assert " I rank " not in r.stderr and "step 2/2" not in r.stderr, r.stderr[-2500:]
    # An OMP_NUM_THREADS that is no number (empty, 0, a word) is no choice of threads: OpenMP
    # ignores it, and it made the ranks oversubscribe the cores (40 to 180 times slower), unsaid.
    r = launch("--nproc-per-node", "2", "--", "train", *args, *DDP, "--set", "trainer.threads=0",
               "--set", "trainer.max_steps=2", "--set", "trainer.name=shared_cores_omp",
               env={**os.environ, "OMP_NUM_THREADS": "abc"})
    assert "OMP_NUM_THREADS = 'abc' is no number of threads (OpenMP ignores it)" in r.stderr \
        and "per process: 2 processes of this job share this machine's" in r.stderr, r.stderr[-2500:]
    # A master address that does not resolve: refused before any rank starts (they would wait
    # parallel.timeout for it).
    started = time.monotonic()
    r = launch("--nproc-per-node", "2", "--master-addr", "no.such.host.invalid", "--", "train", *args, *DDP,
               "--set", "trainer.name=unresolved", timeout=120, check=False)
    assert r.returncode == 1 and "--master-addr no.such.host.invalid does not resolve" in r.stderr, r.stderr[-2500:]
    assert not os.path.exists(os.path.join(work, "unresolved")), "a rank started"
    print(f"an unresolvable --master-addr: refused in {time.monotonic() - started:.1f} s, no rank started")
    # One that resolves but is no address of this machine, node 0's (a typo): rank 0 listens there,
    # and every rank waited parallel.timeout (30 minutes) to reach it. (198.51.100.1: TEST-NET-2.)
    started = time.monotonic()
    r = launch("--nproc-per-node", "2", "--master-addr", "198.51.100.1", "--", "train", *args, *DDP,
               "--set", "trainer.name=not_here", timeout=120, check=False)
    assert r.returncode == 1 and "--master-addr 198.51.100.1 is no address of this machine, which is node 0 (--node-rank 0) " \
        "and holds rank 0" in r.stderr, \
        r.stderr[-2500:]
    assert not os.path.exists(os.path.join(work, "not_here")), "a rank started"
    print(f"a --master-addr of another machine on node 0: refused in {time.monotonic() - started:.1f} s")

    # 5c''. A test split smaller than the world: rank 1 has no sample of it and adds nothing; the
    # figures are the one sample's, as a single process gives them.
    tiny = [*args, "--set", "trainer.max_steps=2", "--set", "data.test_size=1"]
    one = loom(exe, "train", *tiny, "--set", "trainer.name=tiny_test_single")
    r = launch("--nproc-per-node", "2", "--", "train", *tiny, *DDP, "--set", "trainer.name=tiny_test_ddp", check=False)
    assert r.returncode == 0, (r.returncode, r.stderr[-2500:])
    def test_line(err):
        lines = [l.split("test step 2: ", 1)[1].split(" (")[0] for l in err.splitlines() if "test step 2: " in l]
        assert len(lines) == 1, err[-2500:]
        loss, accuracy = lines[0].split(", ")  # "loss 1.3863", "accuracy 100.00 %"
        return float(loss.split()[1]), accuracy
    (loss2, acc2), (loss1, acc1) = test_line(r.stderr), test_line(one.stderr)
    assert abs(loss2 - loss1) < 1e-3 and acc2 == acc1, ((loss2, acc2), (loss1, acc1))
    print(f"a test split of 1 sample on 2 ranks: loss {loss2}, {acc2}, as one process")

    # 5d. A rank waiting to join others that never come (parallel.timeout 300 s): a stop signal ends
    # it at once, in the wait or before it; nothing was written, nothing is saved. The signal goes
    # once the process catches SIGINT and SIGTERM (its /proc status says so): a signal before that,
    # while the libraries load, takes the default action, which writes nothing either (case below).
    def catches_stop_signals(pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                caught = int(next(l for l in f if l.startswith("SigCgt:")).split()[1], 16)
        except (OSError, StopIteration):
            return False
        return caught & (1 << (signal.SIGINT - 1)) and caught & (1 << (signal.SIGTERM - 1))

    def never_joining(sig, settle):
        env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="1",
                   LOCAL_RANK="1")
        p = subprocess.Popen([exe, "train", *long[:-1], "trainer.name=never_joined", "--set", "parallel.timeout=300"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if settle is not None:
                deadline = time.time() + 120
                while not catches_stop_signals(p.pid) and p.poll() is None and time.time() < deadline:
                    time.sleep(0.01)
                if not catches_stop_signals(p.pid):
                    p.kill()
                    raise AssertionError(f"loom train did not come to catch SIGINT and SIGTERM (exit {p.poll()}): "
                                         + p.communicate()[1][-1500:])
                time.sleep(settle)
            sent = time.time()
            p.send_signal(sig)
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        took = time.time() - sent
        assert p.returncode in (-sig, 128 + sig) and took < 20, (sig.name, p.returncode, took, err[-1500:])
        assert not os.path.exists(os.path.join(work, "never_joined")), "a rank that never joined wrote its run folder"
        return took, p.returncode, err

    for sig, settle in ((signal.SIGTERM, 2), (signal.SIGINT, 0)):  # (2 s: into the wait; 0: most likely before it)
        took, code, err = never_joining(sig, settle)
        assert "stopping at once (joining the other ranks" in err or "during set-up (before joining the other ranks)" in err, err
        print(f"{sig.name} to a rank waiting to join: stopped after {took:.1f} s (exit {code})")
    took, code, err = never_joining(signal.SIGINT, None)  # at once: before the handler, or at its first check
    print(f"SIGINT as a rank starts: stopped after {took:.1f} s (exit {code}), nothing written")

    # 6. A whole job killed with SIGKILL resumes with another world size (the global batch and
    # the data position kept) and goes on as the run that never stopped.
    def killed_and_resumed(name, first, then, res, straight):
        run = os.path.join(work, name)
        cmd = ([exe, "launch", "--nproc-per-node", str(first), "--", "train", *res, *DDP] if first > 1
               else [exe, "train", *res])
        job = subprocess.Popen(cmd + ["--set", f"trainer.name={name}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        checkpoints = os.path.join(run, "checkpoints")
        deadline = time.time() + 300
        while time.time() < deadline:
            done = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
            if any(d.startswith("step_") and int(d[5:]) >= 60 for d in done):
                break
            assert job.poll() is None, "the job ended before it could be killed"
            time.sleep(0.01)
        # The whole job at once, as a scheduler kills it: every rank, then the launcher.
        ranks = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        for pid in [*map(int, ranks), job.pid]:
            os.kill(pid, signal.SIGKILL)
        job.wait()
        for pid in map(int, ranks):
            while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
                time.sleep(0.01)
        last = max(int(d[5:]) for d in os.listdir(checkpoints) if d.startswith("step_"))
        steps = max(straight)
        assert last < steps
        again = [*res, "--set", f"trainer.name={name}", "--resume", "auto"]
        if then > 1:
            out = launch("--nproc-per-node", str(then), "--", "train", *again, *DDP)
        else:
            out = loom(exe, "train", *again)
        assert f"at step {last}" in out.stderr, out.stderr[-3000:]
        resumed = losses(run)
        assert sorted(resumed) == list(range(1, steps + 1)), "metrics.jsonl must hold every step once"
        close({s: v for s, v in resumed.items() if s > last}, {s: v for s, v in straight.items() if s > last},
              f"killed with {first} rank(s), resumed with {then}")
        return last

    STEPS = 300
    res = [*BASE, "--set", f"trainer.work_dir={work}", "--set", f"trainer.max_steps={STEPS}",
           "--set", "trainer.checkpoint_every=20", "--set", "trainer.eval_every=100"]
    loom(exe, "train", *res, "--set", "trainer.name=straight")
    straight = losses(os.path.join(work, "straight"))
    for first, then in ((2, 1), (1, 2), (2, 2)):
        last = killed_and_resumed(f"resume_{first}_{then}", first, then, res, straight)
        print(f"killed with {first} rank(s) after step {last}, resumed with {then}: steps {last + 1}..{STEPS} "
              "as the run that never stopped")

    # 7. With dropout, each rank draws its own masks; rank 1's generator is seeded anew at each
    # step from (seed, rank, step), so a job resumed with as many ranks draws what the job that
    # never stopped drew (rank 1 was reseeded once, at the resume, and its losses went their own way,
    # before it was seeded at each step).
    res = [*SMALL, "--set", "trainer.threads=1", "--set", "parallel.timeout=60", "--set", f"trainer.work_dir={work}",
           "--set", "trainer.max_steps=120", "--set", "trainer.checkpoint_every=20", "--set", "trainer.eval_every=100"]
    # (A configuration's warning is said once, by the launcher that checked it, not once more per rank.)
    out = launch("--nproc-per-node", "2", "--", "train", *res, *DDP, "--set", "trainer.name=straight_dropout",
                 "--set", "trainer.log_every=5", "--set", "trainer.log_every=1")
    assert out.stderr.count("trainer.log_every is given 3 times") == 1, out.stderr[-3000:]
    straight = losses(os.path.join(work, "straight_dropout"))
    last = killed_and_resumed("resume_dropout", 2, 2, res, straight)
    print(f"dropout 0.1, killed with 2 ranks after step {last}, resumed with 2: each rank's dropout as the job "
          "that never stopped")
    assert "change in training" not in out.stderr, "the ViT has no buffer a step changes"

    # 8. A model with BatchNorm (a user's CNN): each rank's running statistics come from its own
    # shard; after each step they are rank 0's on every rank, as PyTorch's DDP makes them, so the
    # end-of-run check of the replicas passes (it stopped such a run, after all its training).
    # The plugin is given to the launcher (before --): its ranks take it too (it was ignored).
    bn = os.path.join(os.path.dirname(exe), "..", "tests", "models", "libloom_model_batchnorm_model.so")
    assert os.path.exists(bn), f"{bn} is built with the tests (tests/plugins)"
    out = launch("--plugin-dir", bn, "--nproc-per-node", "2", "--", "train", *BASE, *DDP, "--set", "model.name=batchnorm_model",
                 "--set", f"trainer.work_dir={work}", "--set", "trainer.name=batchnorm", "--set", "trainer.max_steps=30",
                 "--set", "trainer.eval_every=10")
    assert "3 buffers change in training (norm.num_batches_tracked, norm.running_mean, norm.running_var)" in out.stderr, \
        out.stderr[-3000:]
    assert "weights identical on all 2 ranks at the end" in out.stderr, out.stderr[-3000:]
    saved = weights(os.path.join(work, "batchnorm"))
    assert int(saved["buffer.norm.num_batches_tracked"]) == 30, saved["buffer.norm.num_batches_tracked"]
    print("batchnorm_model over 2 ranks: its running statistics rank 0's on both after each step, the replicas "
          "identical at the end")

    # 9. A host name for rank 0 that does not resolve (torchrun's or Slurm's variables, by hand) is
    # said at once; the store retried it for parallel.timeout, printing c10d's warning every few seconds.
    try:
        socket.getaddrinfo("no.such.invalid", None)
        resolves = True
    except socket.gaierror as e:
        resolves = e.errno == socket.EAI_AGAIN  # (no name server answered: the store would try again)
    if not resolves:
        started = time.time()
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="no.such.invalid",
                   MASTER_PORT=str(free_port()))
        r = subprocess.run([exe, "train", *BASE, *DDP, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=nohost",
                            "--set", "parallel.timeout=60"], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 1 and "ddp: rank 0's host no.such.invalid (MASTER_ADDR) does not resolve" in r.stderr, \
            r.stderr[-2000:]
        assert time.time() - started < 30, "said at once, not after parallel.timeout"
        print(f"MASTER_ADDR that does not resolve: said after {time.time() - started:.1f} s")

    # 10. Rank 1 of 2 whose rank 0 never comes: one error line, not c10d's C++ stack of each try
    # (about 50 lines of "frame #N: ... libtorch_cpu.so" before Loom's own error); and what it
    # waits for said after 10 s (a node never started waited parallel.timeout, 30 min, in silence).
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([exe, "train", *BASE, *DDP, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=alone",
                        "--set", "parallel.timeout=11"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "ddp: rank 1 of 2 could not meet the others at 127.0.0.1:" in r.stderr \
        and "frame #" not in r.stderr and "[c10d]" not in r.stderr, r.stderr[-3000:]
    assert re.search(r"ddp: rank 1 still waits to reach rank 0 at 127\.0\.0\.1:\d+, up to 11 s \(parallel\.timeout\): is rank 0 "
                     r"started, and is that its address and port\? \(10 s so far\)", r.stderr), r.stderr[-3000:]
    print("a rank whose rank 0 never comes: what it waits for said at 10 s, then one error, no C++ stack")
    # ... at an IPv6 address: written in brackets, as a URL does ("::1:29500" read as one address).
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="::1", MASTER_PORT=str(free_port()))
    r = subprocess.run([exe, "train", *BASE, *DDP, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=alone6",
                        "--set", "parallel.timeout=2"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and re.search(r"ddp: rank 1 of 2 could not meet the others at \[::1\]:\d+ within 2 s", r.stderr), \
        r.stderr[-3000:]
    print("a rank 0 at an IPv6 address is named [::1]:PORT")
    # ... and rank 0 whose other ranks never come.
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([exe, "train", *BASE, *DDP, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=alone0",
                        "--set", "parallel.timeout=11"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "ddp: rank 0 waits for the other ranks: 0 of 1 arrived in 10 s (up to 11 s" in r.stderr \
        and "ddp: rank 0 of 2: 0 of the 1 other ranks arrived within 11 s" in r.stderr, r.stderr[-3000:]
    print("rank 0 whose other ranks never come: how many arrived said at 10 s, then the error")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("ddp test passed")
