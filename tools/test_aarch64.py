#!/usr/bin/env python3
"""Runs the aarch64 wheel under qemu-user: an aarch64 CPython installs it and runs the tests.

    python tools/test_aarch64.py [--python 3.11 3.13] [WHEEL ...] [-- PYTEST ARGS]

Each interpreter is Debian's CPython for arm64 and the C libraries it needs: python3.11 from
this machine's release (bookworm), python3.13 from the next (trixie), read from the same
Debian archive. apt fetches them into a private state directory (the system's apt setup and
architecture list are not touched) and they are unpacked into build/aarch64-root-<ver>;
qemu-aarch64 runs them with that root as -L. Debian ships no arm64 3.10 or 3.12, and no other
source of interpreters is reachable here, so those two wheels are built and checked by
auditwheel but not run. The wheel and its dependencies (aarch64 wheels from PyPI) are
installed with pip into build/aarch64-site-<ver>, so nothing there was compiled here but the
wheel itself.

Checks, each under `-cpu max` (NEON, dot product, fp16, i8mm) unless said:
  * system_info() names arch aarch64; with `-cpu max` (i8mm) the active ISA is "i8mm" (its
    smmla kernels), with `-cpu neoverse-n1` (dot product, no i8mm) "neon" (its sdot kernels), and
    with `-cpu cortex-a53` (NEON but no dot product) "baseline";
  * the kernel, quantization and backend-op tests, which compare every supported ISA with
    gguf-py and numpy (dequantization bit-exact, matmul, attention).
Needs Debian's qemu-user (apt-get install qemu-user) and network access to the package registries.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
# CPython version -> the Debian release whose arm64 build of it is used.
DEBIAN = {"3.11": "bookworm", "3.13": "trixie"}
# Debian packages that the interpreter's dependency walk names but that it does not need to run.
DEB_SKIP = {"debconf", "perl", "dpkg", "tar", "coreutils", "bash", "install-info", "media-types",
            "tzdata", "readline-common", "libdebconfclient0", "debianutils", "sensible-utils",
            "mime-support", "netbase", "base-files", "mailcap", "sqv", "perl-base"}
PY_DEPS = ["numpy", "gguf", "pytest", "hypothesis", "jinja2", "tqdm"]
DEFAULT_TESTS = ["tests/test_install.py", "tests/test_kernels.py", "tests/test_quant.py",
                 "tests/test_backend_ops.py"]


def log(msg: str) -> None:
    print(f"[test_aarch64] {msg}", flush=True)


def run(cmd, **kw):
    log("+ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def host_codename() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip().strip('"')
    sys.exit("test_aarch64: /etc/os-release names no Debian release")


def sysroot(ver: str) -> Path:
    root = BUILD / f"aarch64-root-{ver}"
    if (root / "usr/bin" / f"python{ver}").exists():
        return root
    suite = DEBIAN[ver]
    apt = BUILD / f"aarch64-apt-{suite}"
    for d in ("state/lists/partial", "cache/archives/partial", "parts", "prefs", "debs"):
        (apt / d).mkdir(parents=True, exist_ok=True)
    (apt / "status").touch()
    # The system's own Debian sources, with its release's name swapped for the wanted one
    # (bookworm-updates -> trixie-updates, ...), read for arm64 into apt state of our own.
    host = host_codename()
    srcs = glob.glob("/etc/apt/sources.list.d/*.sources") + glob.glob("/etc/apt/sources.list.d/*.list")
    if os.path.exists("/etc/apt/sources.list"):
        srcs.append("/etc/apt/sources.list")
    for old in (apt / "parts").iterdir():
        old.unlink()
    for i, src in enumerate(srcs):
        text = Path(src).read_text()
        if host not in text:  # not Debian's archive (a vendor's repository)
            continue
        ext = ".sources" if src.endswith(".sources") else ".list"
        (apt / "parts" / f"{i:02d}{ext}").write_text(text.replace(host, suite))
    opts = ["-oDir::Etc::SourceList=/dev/null", f"-oDir::Etc::SourceParts={apt / 'parts'}",
            "-oDir::Etc::Preferences=/dev/null", f"-oDir::Etc::PreferencesParts={apt / 'prefs'}",
            f"-oDir::State={apt / 'state'}", f"-oDir::State::status={apt / 'status'}",
            f"-oDir::Cache={apt / 'cache'}", "-oAPT::Architecture=arm64", "-oAPT::Architectures::=arm64",
            "-qq"]
    run(["apt-get", *opts, "update"])
    pkgs_in = [f"python{ver}-minimal", f"libpython{ver}-stdlib", "libstdc++6", "libgcc-s1"]
    deps = subprocess.check_output(
        ["apt-cache", *opts, "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
         "--no-breaks", "--no-replaces", "--no-enhances", *pkgs_in], text=True)
    pkgs = sorted({l.strip() for l in deps.splitlines()
                   if l and not l.startswith(" ") and "<" not in l} - DEB_SKIP)
    pkgs = [p for p in pkgs if not p.endswith("-base") and not p.startswith(("libperl", "perl-modules"))]
    for old in (apt / "debs").glob("*.deb"):
        old.unlink()
    run(["apt-get", *opts, "download", *pkgs], cwd=apt / "debs")
    tmp = BUILD / f"aarch64-root-{ver}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for deb in sorted((apt / "debs").glob("*.deb")):
        run(["dpkg-deb", "-x", deb, tmp], stdout=subprocess.DEVNULL)
    # Merged /usr (trixie): the loader and libraries live under usr/lib only, and the /lib
    # link that base-files makes is what the programs' interpreter path goes through.
    for d in ("lib", "bin", "sbin"):
        if not (tmp / d).exists() and (tmp / "usr" / d).is_dir():
            (tmp / d).symlink_to(Path("usr") / d)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def install(wheel: Path, ver: str) -> Path:
    site = BUILD / f"aarch64-site-{ver}"
    shutil.rmtree(site, ignore_errors=True)
    run([sys.executable, "-m", "pip", "install", "-q", "--target", site, "--only-binary=:all:",
         *[a for t in ("2_17", "2_24", "2_27", "2_28") for a in ("--platform", f"manylinux_{t}_aarch64")],
         "--python-version", ver, "--implementation", "cp", wheel, *PY_DEPS])
    return site


def test_one(ver: str, wheel: Path, qemu: str, pytest_args: list[str]) -> None:
    log(f"CPython {ver} (Debian {DEBIAN[ver]}, arm64): {wheel.name}")
    root = sysroot(ver)
    site = install(wheel, ver)
    py = root / "usr/bin" / f"python{ver}"
    # PYTHONPATH is the installed tree only; running from build/ keeps the source tree off sys.path.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "DASLLAMA_TEST_INSTALLED": "1",
           "PYTHONDONTWRITEBYTECODE": "1", "HOME": os.environ.get("HOME", "/root"),
           # The references' BLAS: under qemu 7.2's -cpu max (SVE, SME) numpy 2.5's OpenBLAS picks
           # kernels whose float64 matmul comes out wrong (18 off on a 3x256 @ 256x5 product, where
           # einsum agrees with dasllama on every ISA), so it is held to its Neoverse N1 (NEON) ones.
           # Only numpy's choice changes; dasllama reads HWCAP and still runs i8mm.
           "OPENBLAS_CORETYPE": "NEOVERSEN1"}

    def qpy(cpu: str, *args, **kw):
        return run([qemu, "-cpu", cpu, "-L", root, py, *args], env=env, cwd=BUILD, **kw)

    check = ("import dasllama, json, sys; i = dasllama.system_info(); "
             "print(sys.version.split()[0], json.dumps({k: i[k] for k in ('isa_active', 'isa_compiled', 'isa_supported')}), "
             "i['cpu']['features'])")
    # max: NEON, dot product, fp16, i8mm; neoverse-n1: dot product and fp16, no i8mm (Graviton2);
    # cortex-a53: NEON only (Raspberry Pi 3), which the baseline variant serves.
    for cpu, want in (("max", "i8mm"), ("neoverse-n1", "neon"), ("cortex-a53", "baseline")):
        out = qpy(cpu, "-c", check + f"; assert i['cpu']['arch'] == 'aarch64' and i['isa_active'] == {want!r}, i"
                  f"; assert i['cpu']['features']['i8mm'] == {cpu == 'max'}, i",
                  capture_output=True, text=True)
        log(f"-cpu {cpu}: {out.stdout.strip()}")
    # A timed test means nothing under emulation (it checks native speed). --deselect takes a node id,
    # relative to the rootdir: an absolute path deselects nothing.
    tests = pytest_args or [str(ROOT / t) for t in DEFAULT_TESTS] + [
        "--deselect", "tests/test_quant.py::test_dequantize_smollm2_is_fast"]
    qpy("max", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT, *tests)


def main(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    else:
        pytest_args = []
    vers, wheels = [], []
    it = iter(argv)
    for a in it:
        if a == "--python":
            continue
        (vers if a in DEBIAN or a.startswith("3.") else wheels).append(a)
    for v in vers:
        if v not in DEBIAN:
            sys.exit(f"test_aarch64: no arm64 CPython {v} here (Debian ships {', '.join(DEBIAN)})")
    jobs = []
    for w in wheels:
        tag = Path(w).name.split("-")[2]  # cp311
        ver = f"{tag[2]}.{tag[3:]}"
        if ver not in DEBIAN:
            sys.exit(f"test_aarch64: {Path(w).name} is for CPython {ver}; Debian ships arm64 {', '.join(DEBIAN)}")
        jobs.append((ver, Path(w)))
    if not wheels:
        for ver in vers or list(DEBIAN):
            found = sorted((ROOT / "dist").glob(f"dasllama-*-cp{ver.replace('.', '')}-*aarch64.whl"))
            if not found:
                sys.exit(f"test_aarch64: no cp{ver.replace('.', '')} aarch64 wheel in dist/ "
                         f"(python tools/build_wheels.py --arch aarch64 --python {ver})")
            jobs.append((ver, found[-1]))
    qemu = shutil.which("qemu-aarch64")
    if not qemu:
        sys.exit("test_aarch64: needs qemu-aarch64 (apt-get install qemu-user)")
    for ver, wheel in jobs:
        test_one(ver, wheel, qemu, pytest_args)
    log("passed: " + ", ".join(f"CPython {v} ({w.name})" for v, w in jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
