#!/usr/bin/env python3
"""Compiles every translation unit of Loom against the headers of another LibTorch release.

The GPU test machine has torch 2.11 while Loom builds here against the pinned wheel; an API that
2.11 lacks would be found only there, in its scarce minutes. This check finds it here:

  1. fetch: the torch wheel of that release is downloaded once (pip download --no-deps), its
     headers (torch/include) are extracted into $LOOM_CACHE/torch-<version>-headers, and the
     wheel is deleted (nothing is installed);
  2. check: each compile command of the build (compile_commands.json: core, apps, plugins,
     tests, bench and the in-tree build of the example plugin) is run again, its LibTorch
     include folders pointed at those headers, at -O0 into a scratch object, through ccache
     (a unit that did not change since the last check costs nothing). A translation unit that
     does not compile is reported with the compiler's file:line errors.

    scripts/torch_compat.py --fetch                  # what scripts/setup.sh runs (idempotent)
    scripts/torch_compat.py --build-dir build        # the check (ctest: compat.torch_<version>)

Exit status: 0 when every unit compiles, 1 when one does not, 2 when the check itself cannot
run (no compile_commands.json), 77 with --no-fetch when the headers are not cached.
"""
import argparse
import concurrent.futures
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The GPU test machine's release (../shared/gpu/README.md). Keep in step with docs/gpu.md.
DEFAULT_VERSION = "2.11.0"


def cache_dir():
    return os.environ.get("LOOM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "loom")


def headers_dir(version):
    return os.path.join(cache_dir(), f"torch-{version}-headers")


def fetch(version, python):
    """Downloads the wheel once and keeps only its headers. Returns the include folder."""
    dest = headers_dir(version)
    include = os.path.join(dest, "torch", "include")
    stamp = os.path.join(dest, ".complete")
    if os.path.exists(stamp):
        return include
    print(f"[torch-compat] fetching the headers of torch {version} (one download, then cached in {dest})",
          file=sys.stderr)
    os.makedirs(cache_dir(), exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"torch-{version}-", dir=cache_dir())
    try:
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--cache-dir", os.path.join(cache_dir(), "pip"), "-d", work, f"torch=={version}"],
                       check=True)
        wheels = glob.glob(os.path.join(work, "torch-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"[torch-compat] pip download gave {wheels or 'no wheel'} for torch=={version}")
        staging = os.path.join(work, "out")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith("torch/include/")]
            if not members:
                sys.exit(f"[torch-compat] {os.path.basename(wheels[0])} has no torch/include folder")
            wheel.extractall(staging, members)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(staging, dest)
        with open(stamp, "w") as f:
            f.write(os.path.basename(wheels[0]) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return include


def torch_version_of(include):
    text = open(os.path.join(include, "torch", "headeronly", "version.h")).read()
    found = dict(re.findall(r"#define TORCH_VERSION_(MAJOR|MINOR|PATCH) (\d+)", text))
    return f"{found.get('MAJOR')}.{found.get('MINOR')}.{found.get('PATCH')}"


def retarget(arguments, include, obj):
    """The compile command with its LibTorch include folders (.../torch/include and the folders
    under it) moved to `include`, writing `obj` at -O0, without dependency files. None when the
    command does not use LibTorch."""
    torch_dir = re.compile(r"^(-I|-isystem)?(/\S*?)/torch/include(?=/|$)")
    out, uses_torch, drop_next = [], False, False
    for arg in arguments:
        if drop_next:
            drop_next = False
        elif arg in ("-o", "-MF", "-MT", "-MQ"):
            drop_next = True
        elif arg in ("-MD", "-MMD"):
            pass
        elif torch_dir.match(arg) and not arg.startswith(include):
            uses_torch = True
            out.append(torch_dir.sub(lambda m: (m.group(1) or "") + include, arg))
        else:
            out.append(arg)
    if not uses_torch:
        return None
    if os.path.basename(out[0]) == "ccache":
        out = out[1:]
    # Through ccache when there is one: a unit whose source and headers did not change since the
    # last check is not compiled again (-fsyntax-only would bypass the cache).
    launcher = [shutil.which("ccache")] if shutil.which("ccache") else []
    return launcher + out + ["-O0", "-g0", "-o", obj]


def check(build_dir, include, jobs, only):
    db_path = os.path.join(build_dir, "compile_commands.json")
    if not os.path.exists(db_path):
        print(f"[torch-compat] {db_path} is missing: build first (scripts/build.sh)", file=sys.stderr)
        return 2
    with open(db_path) as f:
        db = json.load(f)
    version = torch_version_of(include)
    with tempfile.TemporaryDirectory(prefix="loom-torch-compat-") as scratch:
        units, seen = [], set()
        for entry in db:
            source = os.path.normpath(os.path.join(entry["directory"], entry["file"]))
            if source in seen or not source.endswith((".cpp", ".cc", ".cxx")):
                continue
            if only and not any(o in source for o in only):
                continue
            args = entry.get("arguments") or shlex.split(entry["command"])
            command = retarget(args, include, os.path.join(scratch, f"{len(units)}.o"))
            if command is not None:
                seen.add(source)
                units.append((source, entry["directory"], command))
        if not units:
            print(f"[torch-compat] no translation unit of {db_path} uses LibTorch", file=sys.stderr)
            return 2

        def compile_one(unit):
            source, directory, command = unit
            t0 = time.monotonic()
            p = subprocess.run(command, cwd=directory, capture_output=True, text=True)
            return source, p.returncode, p.stderr, time.monotonic() - t0

        print(f"[torch-compat] {len(units)} translation units against torch {version} ({include}), {jobs} jobs")
        t0 = time.monotonic()
        failed = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            for source, rc, err, seconds in pool.map(compile_one, sorted(units)):
                rel = os.path.relpath(source, ROOT)
                print(f"  {'ok  ' if rc == 0 else 'FAIL'}  {rel} ({seconds:.1f} s)", flush=True)
                if rc != 0:
                    failed.append((rel, err))
    for rel, err in failed:
        errors = [l for l in err.splitlines() if ": error:" in l or ": fatal error:" in l] or err.splitlines()
        print(f"\n{rel} does not compile against torch {version}:")
        for line in errors[:10]:
            print("  " + (line[len(ROOT) + 1:] if line.startswith(ROOT + "/") else line))
    print(f"\n[torch-compat] {len(units) - len(failed)} of {len(units)} translation units compile against "
          f"torch {version} ({time.monotonic() - t0:.0f} s)")
    if failed:
        print("[torch-compat] keep version differences in sdk/include/loom/sdk/compat.hpp "
              "(LOOM_TORCH_AT_LEAST), see docs/gpu.md")
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default=DEFAULT_VERSION, help="torch release (default %(default)s)")
    p.add_argument("--fetch", action="store_true", help="only make sure the headers are cached")
    p.add_argument("--no-fetch", action="store_true",
                   help="never download: exit 77 (skipped) when the headers are not cached (how ctest runs it)")
    p.add_argument("--python", default=os.environ.get("LOOM_VENV_PYTHON", sys.executable),
                   help="a Python with pip, for the download")
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--only", action="append", default=[], help="check only sources whose path contains this")
    a = p.parse_args()
    if a.no_fetch and not os.path.exists(os.path.join(headers_dir(a.version), ".complete")):
        print(f"[torch-compat] skipped: the headers of torch {a.version} are not in {headers_dir(a.version)} "
              "(scripts/setup.sh fetches them)")
        return 77
    include = fetch(a.version, a.python)
    if a.fetch:
        return 0
    return check(os.path.abspath(a.build_dir), include, a.jobs, a.only)


if __name__ == "__main__":
    sys.exit(main())
