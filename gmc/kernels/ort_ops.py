"""Build, verify and register ``libgmc_ort_ops.so``: gmc's group-sparse linear as an ONNX Runtime custom op.

``ort_group_sparse.cpp`` (with the torch-free core of the torch op's CPU kernel,
``group_sparse_core.h``) defines op ``GroupSparseLinear`` of domain ``gmc`` (its inputs, attributes
and output are in that file's header). This module compiles it with plain ``g++`` (``-O3
-march=native``; no torch, no OpenMP runtime: the op runs on ONNX Runtime's intra-op threads) against
ONNX Runtime's C API headers, from, in order:

1. ``$GMC_ORT_INCLUDE`` (a directory holding ``onnxruntime_c_api.h``);
2. the system's (``apt-get install libonnxruntime-dev`` on Debian 13: ``/usr/include/onnxruntime``);
3. Debian 13's ``libonnxruntime-dev`` 1.21.0 package, fetched once from deb.debian.org, its sha256
   checked against ``HEADERS_DEB_SHA256``, and unpacked (not installed) into
   ``$GMC_CACHE/onnxruntime-headers/1.21.0``; ``GMC_ORT_FETCH=0`` forbids the download.

The library needs no libonnxruntime to link: it takes the API table from ``RegisterCustomOps``, and
runs on the runtime whose API version is at least its headers' (21 for 1.21; the wheel is newer).

A build goes into ``$GMC_CACHE/cpu_kernels/gmc_ort_ops_<digest>`` (private, as the torch kernel's
builds: ``cpu_group_sparse.build_directory``), keyed by the sources, flags, compiler, headers and this
CPU's model and flags, built in a temporary file and renamed, under the directory's build lock.
Beside the ``.so`` a stamp, ``libgmc_ort_ops.json``, records the ORT API version, ``-march``, the ISA
flags the build may use, the compiler, the platform and the ``.so``'s sha256. Loading a library runs
its code, so ``check_library`` refuses one whose stamp is missing or does not match the file, this
host's platform or ISA, or whose sha256 is not one of gmc's own builds in this cache, before anything
loads it; ``register`` checks, then adds the library to an ``onnxruntime.SessionOptions``.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Optional

from gmc.config import __version__, cache_root
from gmc.errors import GmcError
from gmc.kernels.cpu_group_sparse import (
    UnsafeBuildDirectory,
    _building,
    _check_not_replaceable,
    _check_private,
    _cpu_signature,
    build_directory,
)

KERNELS = Path(__file__).parent
SOURCES = (KERNELS / "ort_group_sparse.cpp", KERNELS / "group_sparse_core.h", KERNELS / "group_sparse_products.h")
LIBRARY = "libgmc_ort_ops.so"
STAMP = "libgmc_ort_ops.json"
BUILD_PREFIX = "gmc_ort_ops_"  # build directories under $GMC_CACHE/cpu_kernels

INCLUDE_ENV = "GMC_ORT_INCLUDE"
FETCH_ENV = "GMC_ORT_FETCH"  # "0": never download the headers
SYSTEM_INCLUDE = Path("/usr/include/onnxruntime")
HEADERS_VERSION = "1.21.0"
HEADERS_DEB = ("https://deb.debian.org/debian/pool/main/o/onnxruntime/"
               "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb")
HEADERS_DEB_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
MIN_API_VERSION = 17  # KernelContext_ParallelFor, CreateKernelV2, GetStartVersion

MARCH = "native"
FLAGS = ("-std=c++17", "-O3", f"-march={MARCH}", "-ffp-contract=fast", "-fopenmp-simd", "-shared", "-fPIC",
         "-fvisibility=hidden", "-Wl,-z,defs")
# CPU flags (/proc/cpuinfo names) a -march=native build may use: a library built where one of them
# is present does not run where it is absent.
ISA_FLAGS = frozenset({
    "sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "abm", "movbe", "aes", "pclmulqdq", "sha_ni",
    "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "adx", "rdrand", "rdseed", "xsave", "clflushopt", "clwb",
    "3dnowprefetch", "gfni", "vaes", "vpclmulqdq", "avx_vnni", "avx512f", "avx512cd", "avx512bw", "avx512dq",
    "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "movdiri", "movdir64b", "serialize",
    "waitpkg", "asimd", "fp", "sve", "sve2", "asimddp", "asimdhp", "i8mm", "bf16",
})

_state: dict = {}


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (x86 ``flags``, Arm ``Features``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _platform() -> str:
    """What a shared library is bound to besides the ISA: OS, machine and C library."""
    libc, version = platform.libc_ver()
    return f"{platform.system()}-{platform.machine()}-{libc}{version}"


def _cpu_model() -> str:
    return _cpu_signature().partition("\n")[0].partition(":")[2].strip() or platform.machine()


def _compiler() -> Optional[str]:
    return shutil.which("g++") or shutil.which("c++")


def _api_version(include: Path) -> int:
    """ORT_API_VERSION of the headers in ``include``."""
    found = re.search(r"#define\s+ORT_API_VERSION\s+(\d+)", (include / "onnxruntime_c_api.h").read_text())
    if not found:
        raise GmcError(f"{include}/onnxruntime_c_api.h defines no ORT_API_VERSION: not ONNX Runtime's C API header")
    return int(found.group(1))


def include_dir() -> Path:
    """The directory of ONNX Runtime's C API headers (see the module docstring for the order), fetched
    into the cache when none is on the machine; GmcError (one line) when there is none."""
    if os.environ.get(INCLUDE_ENV):
        include = Path(os.environ[INCLUDE_ENV])
        if not (include / "onnxruntime_c_api.h").is_file():
            raise GmcError(f"{INCLUDE_ENV}={include}: no onnxruntime_c_api.h there")
        return include
    if (SYSTEM_INCLUDE / "onnxruntime_c_api.h").is_file():
        return SYSTEM_INCLUDE
    cached = _headers_cache()
    if (cached / "onnxruntime_c_api.h").is_file():
        for directory in (cached.parent, cached):  # compiled into a library gmc loads: nobody else's files
            _check_private(directory)
        return cached
    if os.environ.get(FETCH_ENV, "1") == "0":
        raise GmcError(f"ONNX Runtime headers not found: apt-get install libonnxruntime-dev (Debian 13), set "
                       f"{INCLUDE_ENV} to their directory, or unset {FETCH_ENV}=0 to let gmc fetch Debian's "
                       f"libonnxruntime-dev {HEADERS_VERSION}")
    return _fetch_headers(cached)


def _headers_cache() -> Path:
    return cache_root().absolute() / "onnxruntime-headers" / HEADERS_VERSION


def _fetch_headers(target: Path) -> Path:
    """Debian's libonnxruntime-dev package downloaded, checked against HEADERS_DEB_SHA256 and its
    ``usr/include/onnxruntime`` unpacked into ``target`` (whole or not at all)."""
    try:
        with urllib.request.urlopen(HEADERS_DEB, timeout=60) as response:
            package = response.read()
    except OSError as error:
        raise GmcError(f"ONNX Runtime headers not found and fetching {HEADERS_DEB} failed ({error}): apt-get "
                       f"install libonnxruntime-dev (Debian 13) or set {INCLUDE_ENV}") from error
    digest = hashlib.sha256(package).hexdigest()
    if digest != HEADERS_DEB_SHA256:
        raise GmcError(f"{HEADERS_DEB} has sha256 {digest}, expected {HEADERS_DEB_SHA256}: not unpacked")
    target.parent.parent.parent.mkdir(parents=True, exist_ok=True)
    _check_not_replaceable(target.parent.parent.parent)
    for directory in (target.parent.parent, target.parent):
        directory.mkdir(mode=0o700, exist_ok=True)
        _check_private(directory)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        for name, data in _headers_in_deb(package):
            path = partial / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if not (partial / "onnxruntime_c_api.h").is_file():
            raise GmcError(f"{HEADERS_DEB} holds no usr/include/onnxruntime/onnxruntime_c_api.h")
        try:
            os.rename(partial, target)
        except OSError:  # another process unpacked it first
            if not (target / "onnxruntime_c_api.h").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _headers_in_deb(package: bytes):
    """``(path under usr/include/onnxruntime, bytes)`` of each header in a .deb: an ar archive whose
    ``data.tar.*`` member holds the files. Regular files only, no path leaving the directory."""
    if not package.startswith(b"!<arch>\n"):
        raise GmcError(f"{HEADERS_DEB} is not a Debian package (no ar header)")
    at = 8
    while at + 60 <= len(package):
        header = package[at:at + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        data = package[at + 60:at + 60 + size]
        at += 60 + size + size % 2
        if not name.startswith("data.tar"):
            continue
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            for member in archive.getmembers():
                path = Path(os.path.normpath(member.name))
                if not member.isfile() or path.parts[:3] != ("usr", "include", "onnxruntime") or ".." in path.parts:
                    continue
                yield Path(*path.parts[3:]), archive.extractfile(member).read()
        return
    raise GmcError(f"{HEADERS_DEB} holds no data.tar member")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest(compiler: str, version: str, include: Path) -> str:
    """What a build depends on: sources, flags, compiler, headers and this CPU."""
    parts = [path.read_text() for path in SOURCES]
    parts += [" ".join(FLAGS), compiler, version, (include / "onnxruntime_c_api.h").read_text(), _cpu_signature()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _stamp_matches(library: Path) -> bool:
    """``library`` and its stamp exist and agree (a complete build)."""
    stamp = library.with_name(STAMP)
    try:
        return library.is_file() and json.loads(stamp.read_text()).get("sha256") == _sha256(library)
    except (OSError, ValueError):
        return False


def build_library() -> Path:
    """``libgmc_ort_ops.so`` for this CPU, built now or found in the cache; GmcError (one line) when
    there is no compiler, no headers, the cache is not private, or the build fails."""
    try:
        return _build()
    except UnsafeBuildDirectory as error:
        raise GmcError(str(error)) from error


def _build() -> Path:
    compiler = _compiler()
    if compiler is None:
        raise GmcError("no C++ compiler (g++) on PATH to build gmc's ONNX Runtime op: apt-get install g++")
    include = include_dir()
    api = _api_version(include)
    if api < MIN_API_VERSION:
        raise GmcError(f"ONNX Runtime headers in {include} are API {api}: gmc's op needs {MIN_API_VERSION} (1.17) "
                       "or newer")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.partition("\n")[0]
    root = build_directory(BUILD_PREFIX + _digest(compiler, version, include))
    library = root / LIBRARY
    with _building(root):  # one builder at a time; a reader sees no stamp until the .so is in place
        if _stamp_matches(library):
            return library
        partial = root / f"partial-{os.getpid()}.so"
        command = [compiler, *FLAGS, f"-I{include}", str(SOURCES[0]), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise GmcError(f"building {LIBRARY} failed: {(errors or ['no output'])[0].strip()[:300]}")
        library.with_name(STAMP).unlink(missing_ok=True)
        os.replace(partial, library)
        stamp = {"library": LIBRARY, "sha256": _sha256(library), "ort_api_version": api,
                 "ort_headers": str(include), "march": MARCH, "cpu": _cpu_model(),
                 "cpu_signature": hashlib.sha256(_cpu_signature().encode()).hexdigest()[:12],
                 "cpu_flags_needed": sorted(_cpu_flags() & ISA_FLAGS), "compiler": version, "flags": list(FLAGS),
                 "platform": _platform(), "gmc_version": __version__}
        partial_stamp = root / f"partial-{os.getpid()}.json"
        partial_stamp.write_text(json.dumps(stamp, indent=1) + "\n")
        os.replace(partial_stamp, library.with_name(STAMP))
    return library


def library_path() -> Optional[Path]:
    """The library for this CPU (built at the first call, then cached for the process), or None when it
    cannot be built: ``why_not()`` says why."""
    if "path" not in _state:
        try:
            _state.update(path=build_library(), why="")
        except (GmcError, OSError) as error:
            _state.update(path=None, why=str(error).strip().splitlines()[0] if str(error).strip() else repr(error))
    return _state["path"]


def why_not() -> str:
    """Why ``library_path()`` is None, in one line ("" when the library is there)."""
    library_path()
    return _state["why"]


def build_or_say() -> None:
    """Build the library, or print one line why not (for scripts/setup.sh: never fails)."""
    path = library_path()
    print(f"gmc ONNX Runtime op: {path}" if path else f"gmc ONNX Runtime op: not built ({why_not()})")


def _own_builds() -> set[str]:
    """sha256 of every library gmc built into this cache (stamps in private build directories)."""
    hashes = set()
    for directory in (cache_root().absolute() / "cpu_kernels").glob(BUILD_PREFIX + "*"):
        try:
            _check_private(directory)
            hashes.add(json.loads((directory / STAMP).read_text())["sha256"])
        except (OSError, ValueError, KeyError, RuntimeError):
            continue
    return hashes


def check_library(path) -> dict:
    """Refuse (GmcError, one line) to vouch for ``path`` unless its stamp is beside it and matches the
    file's sha256, this host's platform and ISA, and that sha256 is one of gmc's own builds in this
    cache; returns the stamp. Nothing is loaded: run this before ``register_custom_ops_library``."""
    path = Path(path)
    stamp_path = path.with_name(STAMP)
    if not path.is_file():
        raise GmcError(f"{path}: no such ONNX Runtime op library")
    if not stamp_path.is_file():
        raise GmcError(f"{path}: no {STAMP} beside it: gmc loads only op libraries it built and stamped")
    try:
        stamp = json.loads(stamp_path.read_text())
        recorded, built_on, needed = stamp["sha256"], stamp["platform"], set(stamp["cpu_flags_needed"])
    except (ValueError, KeyError, TypeError) as error:
        raise GmcError(f"{stamp_path}: not a stamp gmc wrote ({error!r})") from error
    if _sha256(path) != recorded:
        raise GmcError(f"{path}: its sha256 differs from its stamp's: the file changed after gmc built it")
    if built_on != _platform():
        raise GmcError(f"{path}: built for {built_on}, this host is {_platform()}")
    missing = needed - _cpu_flags()
    if missing:
        raise GmcError(f"{path}: built for a CPU with {', '.join(sorted(missing))}, which this CPU lacks")
    if recorded not in _own_builds():
        raise GmcError(f"{path}: not a library gmc built in {cache_root().absolute() / 'cpu_kernels'}: gmc loads only "
                       "its own builds (register() without a path builds this host's)")
    return stamp


def register(session_options, path=None) -> Path:
    """Add gmc's op library (``path``, default this host's build) to an ``onnxruntime.SessionOptions``
    after ``check_library``; returns its path. GmcError (one line) when there is none, it is refused,
    the runtime's API is older than the library's, or ONNX Runtime cannot load it."""
    import onnxruntime

    if path is None:
        path = library_path()
        if path is None:
            raise GmcError(f"gmc's ONNX Runtime op library is not available: {why_not()}")
    path = Path(path)
    stamp = check_library(path)
    runtime = onnxruntime.__version__
    minor = re.match(r"1\.(\d+)", runtime)
    if minor and int(minor.group(1)) < int(stamp.get("ort_api_version", 0)):
        raise GmcError(f"{path} needs ONNX Runtime API {stamp['ort_api_version']} (1.{stamp['ort_api_version']}) or "
                       f"newer, this is onnxruntime {runtime}")
    try:
        session_options.register_custom_ops_library(str(path))
    except Exception as error:  # onnxruntime's own exception types: one line of theirs
        reason = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        raise GmcError(f"ONNX Runtime could not load {path}: {reason[:300]}") from error
    return path
