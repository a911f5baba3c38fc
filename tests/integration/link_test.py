"""Every Loom binary binds std::filesystem to libstdc++, by symbol version (Note [libstdc++ first] in
cmake/LoomTorch.cmake).

Some torch wheels export unversioned copies of std::filesystem's functions (torch 2.11's
libtorch.so, whose remove_all calls through a null pointer). A binary whose linker met such a copy
before libstdc++ records an unversioned reference, and the dynamic linker then prefers the
unversioned copy to libstdc++'s versioned definition wherever libstdc++ sits in the load order:
on the H200 every run that removed a folder crashed. This test reads the dynamic symbols of `loom`,
the SDK library and every built plugin (`readelf --dyn-syms`) and fails on any undefined
std::filesystem symbol without a GLIBCXX version, naming the binary and the symbol."""
import glob
import os
import shutil
import subprocess
import sys

exe = sys.argv[1]
if shutil.which("readelf") is None:
    print("readelf not found (Debian: binutils): skipped")
    sys.exit(77)

build = os.path.dirname(os.path.dirname(os.path.abspath(exe)))
binaries = [exe] + sorted(glob.glob(os.path.join(build, "lib", "libloom_sdk.so"))) + \
    sorted(glob.glob(os.path.join(build, "lib", "loom", "plugins", "*.so")))
plugins = [b for b in binaries if "/plugins/" in b]
if not plugins:
    print(f"no plugins under {build}/lib/loom/plugins: the build is incomplete")
    sys.exit(1)

problems = []
references = 0
for binary in binaries:
    out = subprocess.run(["readelf", "--dyn-syms", "-W", binary], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(fields) < 8 or fields[6] != "UND":
            continue
        name = fields[7]
        if not (name.startswith("_ZNSt10filesystem") or name.startswith("_ZNKSt10filesystem")):
            continue
        references += 1
        if "@GLIBCXX_" not in name:
            problems.append(f"{os.path.relpath(binary, build)}: {name} has no GLIBCXX version")

print(f"{len(binaries)} binaries ({len(plugins)} plugins), {references} std::filesystem references")
if references == 0:
    print("no std::filesystem reference found at all: the check would prove nothing")
    sys.exit(1)
if problems:
    print("unversioned std::filesystem references (they may bind to a LibTorch copy at run time; link "
          "libstdc++ before LibTorch, Note [libstdc++ first] in cmake/LoomTorch.cmake):")
    print("\n".join(problems[:40]))
    sys.exit(1)
print("every reference carries a GLIBCXX version")
