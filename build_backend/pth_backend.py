"""The build backend: setuptools', plus zero3_recompute.pth at the root of every wheel it builds.

The .pth is what activates the patch in an unchanged training script (zero3_recompute/autoload.py).
A .pth works only at the top of site-packages, outside any package, where setuptools puts no
file of its own accord. So each wheel setuptools builds, regular or PEP 660 editable, is opened
here after the fact, and the .pth is added with its line in RECORD. That uses only the public
PEP 517/660 hooks and the wheel format (PEP 427), no setuptools internals. In an editable wheel
the .pth sorts after setuptools' __editable__ one, so the package is importable when it runs.
"""
import base64
import hashlib
import os
import shutil
import tempfile
import zipfile

from setuptools import build_meta as _setuptools

PTH = "zero3_recompute.pth"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
get_requires_for_build_wheel = _setuptools.get_requires_for_build_wheel
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
prepare_metadata_for_build_wheel = _setuptools.prepare_metadata_for_build_wheel
prepare_metadata_for_build_editable = _setuptools.prepare_metadata_for_build_editable
build_sdist = _setuptools.build_sdist


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    return f"sha256={digest}"


def add_pth(wheel_path: str) -> None:
    """Rewrite the wheel at ``wheel_path`` with the .pth at its root and listed in its RECORD."""
    with open(os.path.join(HERE, PTH), "rb") as source:
        pth = source.read()
    with zipfile.ZipFile(wheel_path) as wheel:
        names = wheel.namelist()
        records = [name for name in names if name.endswith(".dist-info/RECORD") and name.count("/") == 1]
        if len(records) != 1:
            raise RuntimeError(f"expected one .dist-info/RECORD in {wheel_path}, got {records}")
        if PTH in names:
            raise RuntimeError(f"{wheel_path} already has {PTH}; expected setuptools to leave it out")
        record_name = records[0]
        record = wheel.read(record_name).decode("utf-8")
        handle, partial = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(wheel_path))
        os.close(handle)
        try:
            with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as out:
                for info in wheel.infolist():
                    if info.filename != record_name:
                        out.writestr(info, wheel.read(info.filename))
                entry = zipfile.ZipInfo(PTH, date_time=(1980, 1, 1, 0, 0, 0))
                entry.external_attr = 0o644 << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                out.writestr(entry, pth)
                lines = [line for line in record.splitlines() if line]
                lines.insert(len(lines) - 1 if lines and lines[-1].startswith(record_name + ",") else len(lines),
                             f"{PTH},{_record_hash(pth)},{len(pth)}")
                out.writestr(wheel.getinfo(record_name), "\n".join(lines) + "\n")
        except BaseException:
            os.unlink(partial)
            raise
    shutil.move(partial, wheel_path)
