"""The GPT-2 recommender end to end (configs/gpt2_recommender_debug.ini, docs/recommender.md):

- quality: on synthetic_interactions, whose best achievable metrics follow from its generator,
  the debug GPT-2 recommender reaches HR@10 >= 0.9 x the Bayes-optimal HR@10 (ranking) and
  RMSE <= 1.1 x the noise's deviation (rating) on the test split, on CPU, well within 10 minutes;
- `loom recommend` on the checkpoint: the top items of a user, none of the items the user has.

    python recommender_test.py LOOM_EXE SOURCE_DIR
"""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import loom, workdir  # noqa: E402

exe, source = sys.argv[1], sys.argv[2]
config = os.path.join(source, "configs", "gpt2_recommender_debug.ini")
work = workdir()


def train(name, *extra):
    r = loom(exe, "train", "-c", config, "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
             "--set", "trainer.device=cpu", *extra)
    return r.stdout + r.stderr


def number(pattern, text):
    m = re.search(pattern, text)
    if not m:
        print(text)
        raise SystemExit(f"no match for {pattern!r}")
    return float(m.group(1))


# Ranking, the config as it is.
out = train("ranking")
best = number(r"expected test HR@10 of the Bayes-optimal ranking is ([0-9.]+)", out)
hr = number(r"test step \d+: .*HR@10 ([0-9.]+)", out)
print(f"ranking: test HR@10 {hr:.4f}, optimum {best:.4f} ({hr / best:.3f} x)")
assert hr >= 0.9 * best, f"HR@10 {hr} < 0.9 x the optimum {best}"

# Rating: users who rate every genre (affinity 0.2), 60 ratings each.
out = train("rating", "--set", "data.task=rating", "--set", "data.affinity=0.2", "--set", "data.per_user=60",
            "--set", "trainer.max_steps=600", "--set", "trainer.eval_every=200")
floor = number(r"best achievable RMSE is ([0-9.]+)", out)
rmse = number(r"test step \d+: .*RMSE ([0-9.]+)", out)
print(f"rating: test RMSE {rmse:.4f}, noise floor {floor:.4f} ({rmse / floor:.3f} x)")
assert rmse <= 1.1 * floor, f"RMSE {rmse} > 1.1 x the noise floor {floor}"

# The top 10 of user 7, from the ranking run's best checkpoint.
checkpoint = os.path.join(work, "ranking", "checkpoints", "best_hr_at_10.safetensors")
r = loom(exe, "recommend", "--checkpoint", checkpoint, "--user", "7", "--top", "10")
rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s+-?[0-9.]+\s", line)]
print(r.stdout)
assert len(rows) == 10, r.stdout
known = int(re.search(r"\((\d+) items they know left out\)", r.stdout).group(1))
assert known == 30, r.stdout  # data.per_user: each user's 28 training, 1 validation and 1 test items
scores = [float(row[2]) for row in rows]
assert scores == sorted(scores, reverse=True), scores
# The whole catalogue asked for: every item but the 30 the user has, each once.
r = loom(exe, "recommend", "--checkpoint", checkpoint, "--user", "7", "--top", "100000")
listed = [line.split()[1] for line in r.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
assert len(listed) == 240 - 30 and len(set(listed)) == len(listed), len(listed)

# The same user written 07: the id the data reads as 7.
r7 = loom(exe, "recommend", "--checkpoint", checkpoint, "--user", "07", "--top", "100000")
assert "for user 7 (given as 07)" in r7.stdout, r7.stdout
assert [line.split()[1] for line in r7.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)] == listed, r7.stdout



def with_tensor_set(src, dst, name, value):
    """A copy of the safetensors file `src` with every value of float32 tensor `name` set to `value`,
    its loom_crc32 made again (as core/src/safetensors.cpp computes it): a file Loom reads as sound."""
    import json
    import struct
    import zlib
    b = bytearray(open(src, "rb").read())
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    begin, end = header[name]["data_offsets"]
    assert header[name]["dtype"] == "F32", header[name]
    b[8 + n + begin:8 + n + end] = struct.pack("<f", value) * ((end - begin) // 4)
    crc = 0
    for key in sorted(k for k in header if k != "__metadata__"):
        x = header[key]
        line = f"{key}|{x['dtype']}|{''.join(str(d) + ',' for d in x['shape'])}|{x['data_offsets'][0]}|{x['data_offsets'][1]}\n"
        crc = zlib.crc32(line.encode(), crc)
    crc = zlib.crc32(bytes(b[8 + n:]), crc)
    old = header["__metadata__"]["loom_crc32"]
    text = bytes(b[8:8 + n]).replace(f'"loom_crc32":"{old}"'.encode(), f'"loom_crc32":"{crc:08x}"'.encode())
    assert len(text) == n
    b[8:8 + n] = text
    open(dst, "wb").write(b)


# A model whose scores overflow (finite weights, 3e38 each): its "top items" were printed as inf,
# exit 0, where `loom eval` refuses the file.
overflowing = os.path.join(work, "overflowing.safetensors")
with_tensor_set(checkpoint, overflowing, "param.mlp_out.weight", 3e38)
r = loom(exe, "recommend", "--checkpoint", overflowing, "--user", "7", "--top", "3", check=False)
assert r.returncode == 1 and re.search(r"the model of .*overflowing\.safetensors gives \d+ of its 240 scores for user 7 as NaN "
                                       r"or infinite, so it ranks nothing", r.stderr) and "inf" not in r.stdout, (r.stdout, r.stderr)
# A model that gives every item one score: said, the order being the sort's.
flat = os.path.join(work, "flat.safetensors")
with_tensor_set(checkpoint, flat, "param.mlp_out.weight", 0.0)
r = loom(exe, "recommend", "--checkpoint", flat, "--user", "7", "--top", "3")
assert "the ranking below is arbitrary (the model has collapsed to one output)" in r.stderr, r.stderr
r = loom(exe, "recommend", "--checkpoint", checkpoint, "--user", "9999", check=False)
assert r.returncode != 0 and re.search(r"user 9999 is not in the data \(\d+ users, ids \d+ to \d+; ", r.stderr), r.stderr
# A 100 KB id was echoed whole in its error; an escape in one reached the terminal.
r = loom(exe, "recommend", "--checkpoint", checkpoint, "--user", "7" * 100000, check=False)
assert r.returncode == 1 and "...' (100000 bytes) is no user id: ids are at most 256 characters" in r.stderr and len(r.stderr) < 2000, r.stderr
r = loom(exe, "recommend", "--checkpoint", checkpoint, "--user", "7\x1b]0;x\x07", check=False)
assert r.returncode == 1 and "--user '7?]0;x?' is no user id" in r.stderr and "\x1b" not in r.stderr, r.stderr

def stopped_in_setup(name, said_after, *sets):
    """Trains run `name` with `sets`, sends SIGINT once stderr has a line holding `said_after` (a
    progress line, said after 15 s of the work); returns (return code, stderr, seconds to the end)."""
    args = [exe, "train", "-c", config, "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
            "--set", "trainer.device=cpu", "--set", "trainer.max_steps=2"]
    for s in sets:
        args += ["--set", s]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said, sent = [], None
    for line in p.stderr:
        said.append(line)
        if said_after in line:
            p.send_signal(signal.SIGINT)
            sent = time.time()
            break
    assert sent is not None, "".join(said)[-2000:]
    _, err = p.communicate(timeout=600)
    return p.returncode, "".join(said) + err, time.time() - sent


# Ctrl-C while set-up encodes the catalogue's text through GPT-2 (minutes on a CPU for MovieLens
# 1M): the stop is acted on within a chunk of items, not when the whole catalogue is done.
rc, err, took = stopped_in_setup("encoding", "encoding the items' text through GPT-2:", "model.size=gpt2", "data.items=20000")
assert rc == 130 and "stopped by SIGINT during set-up (gpt2_recommender: stopped while encoding the items' text" in err \
    and took < 60 and not os.path.exists(os.path.join(work, "encoding")), (rc, err[-2000:])
print(f"SIGINT while encoding: stopped {took:.1f} s after it")
# Ctrl-C while synthetic_interactions generates a large catalogue's interactions (a probe waited
# 37 s in silence for 5 million items): acted on within a user, not when every user is done.
rc, err, took = stopped_in_setup("generating", "synthetic_interactions: generating the users' interactions:", "data.items=5000000")
assert rc == 130 and "stopped while generating the users' interactions, " in err and took < 30 \
    and not os.path.exists(os.path.join(work, "generating")), (rc, took, err[-2000:])
print(f"SIGINT while generating: stopped {took:.1f} s after it")
print("ok")
