#!/usr/bin/env python3
"""Runs the aarch64 wheel under qemu-user: an aarch64 CPython installs it and runs the tests.

    python tools/test_aarch64.py [WHEEL] [-- PYTEST ARGS]

The interpreter is Debian's python3.11 for arm64 and the C libraries it needs, fetched by
apt into a private state directory (the system's apt setup and architecture list are not
touched) and unpacked into build/aarch64-root; qemu-aarch64 runs it with that root as -L.
The wheel and its dependencies (aarch64 wheels from PyPI) are installed with pip into
build/aarch64-site, so nothing there was compiled here but the wheel itself.

Checks, each under `-cpu max` (NEON, dot product, fp16, i8mm) unless said:
  * system_info() names arch aarch64; with `-cpu max` the active ISA is "neon", and with
    `-cpu cortex-a53` (NEON but no dot product) it is "baseline";
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
PYVER = "3.11"
DEB_PKGS = ["python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libgcc-s1"]
# Debian packages that the interpreter's dependency walk names but that it does not need to run.
DEB_SKIP = {"debconf", "perl", "dpkg", "tar", "coreutils", "bash", "install-info", "media-types",
            "tzdata", "readline-common", "libdebconfclient0", "debianutils", "sensible-utils",
            "mime-support", "netbase", "base-files", "libperl5.36", "perl-modules-5.36", "mailcap"}
PY_DEPS = ["numpy", "gguf", "pytest", "hypothesis", "jinja2", "tqdm"]
DEFAULT_TESTS = ["tests/test_install.py", "tests/test_kernels.py", "tests/test_quant.py",
                 "tests/test_backend_ops.py"]


def log(msg: str) -> None:
    print(f"[test_aarch64] {msg}", flush=True)


def run(cmd, **kw):
    log("+ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def sysroot() -> Path:
    root = BUILD / "aarch64-root"
    if (root / "usr/bin" / f"python{PYVER}").exists():
        return root
    apt = BUILD / "aarch64-apt"
    for d in ("state/lists/partial", "cache/archives/partial", "parts", "prefs", "debs"):
        (apt / d).mkdir(parents=True, exist_ok=True)
    (apt / "status").touch()
    # The system's own Debian sources, read for arm64 into apt state of our own.
    for src in glob.glob("/etc/apt/sources.list.d/*.sources") + glob.glob("/etc/apt/sources.list.d/*.list"):
        shutil.copy(src, apt / "parts")
    if os.path.exists("/etc/apt/sources.list"):
        shutil.copy("/etc/apt/sources.list", apt / "parts" / "00-main.list")
    opts = [f"-oDir::Etc::SourceList=/dev/null", f"-oDir::Etc::SourceParts={apt / 'parts'}",
            f"-oDir::Etc::Preferences=/dev/null", f"-oDir::Etc::PreferencesParts={apt / 'prefs'}",
            f"-oDir::State={apt / 'state'}", f"-oDir::State::status={apt / 'status'}",
            f"-oDir::Cache={apt / 'cache'}", "-oAPT::Architecture=arm64", "-oAPT::Architectures::=arm64",
            "-qq"]
    run(["apt-get", *opts, "update"])
    deps = subprocess.check_output(
        ["apt-cache", *opts, "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
         "--no-breaks", "--no-replaces", "--no-enhances", *DEB_PKGS], text=True)
    pkgs = sorted({l.strip() for l in deps.splitlines()
                   if l and not l.startswith(" ") and "<" not in l} - DEB_SKIP)
    pkgs = [p for p in pkgs if not p.endswith("-base")]
    run(["apt-get", *opts, "download", *pkgs], cwd=apt / "debs")
    tmp = BUILD / "aarch64-root.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for deb in sorted((apt / "debs").glob("*.deb")):
        run(["dpkg-deb", "-x", deb, tmp], stdout=subprocess.DEVNULL)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def install(wheel: Path) -> Path:
    site = BUILD / "aarch64-site"
    shutil.rmtree(site, ignore_errors=True)
    run([sys.executable, "-m", "pip", "install", "-q", "--target", site, "--only-binary=:all:",
         *[a for t in ("2_17", "2_24", "2_27", "2_28") for a in ("--platform", f"manylinux_{t}_aarch64")],
         "--python-version", PYVER, "--implementation", "cp", wheel, *PY_DEPS])
    return site


def main(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    else:
        pytest_args = []
    if argv:
        wheel = Path(argv[0])
    else:
        found = sorted((ROOT / "dist").glob(f"dasllama-*-cp{PYVER.replace('.', '')}-*aarch64.whl"))
        if not found:
            sys.exit("test_aarch64: no aarch64 wheel in dist/ (python tools/build_wheels.py --arch aarch64)")
        wheel = found[-1]
    qemu = shutil.which("qemu-aarch64")
    if not qemu:
        sys.exit("test_aarch64: needs qemu-aarch64 (apt-get install qemu-user)")
    root = sysroot()
    site = install(wheel)
    py = root / "usr/bin" / f"python{PYVER}"
    # PYTHONPATH is the installed tree only; running from build/ keeps the source tree off sys.path.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "DASLLAMA_TEST_INSTALLED": "1",
           "PYTHONDONTWRITEBYTECODE": "1", "HOME": os.environ.get("HOME", "/root")}

    def qpy(cpu: str, *args, **kw):
        return run([qemu, "-cpu", cpu, "-L", root, py, *args], env=env, cwd=BUILD, **kw)

    check = ("import dasllama, json; i = dasllama.system_info(); "
             "print(json.dumps({k: i[k] for k in ('isa_active', 'isa_compiled', 'isa_supported')}), "
             "i['cpu']['features'])")
    for cpu, want in (("max", "neon"), ("cortex-a53", "baseline")):
        out = qpy(cpu, "-c", check + f"; assert i['cpu']['arch'] == 'aarch64' and i['isa_active'] == {want!r}, i",
                  capture_output=True, text=True)
        log(f"-cpu {cpu}: {out.stdout.strip()}")
    # A timed test means nothing under emulation (it checks native speed).
    tests = pytest_args or [str(ROOT / t) for t in DEFAULT_TESTS] + [
        "--deselect", str(ROOT / "tests/test_quant.py::test_dequantize_smollm2_is_fast")]
    qpy("max", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT, *tests)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
