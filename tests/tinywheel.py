"""Tiny pure-Python wheels made on the spot, for tests that run pip offline.

A wheel is a zip with a dist-info; no build backend, no download.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(
    wheelhouse: Path,
    name: str,
    version: str,
    *,
    requires: tuple[str, ...] = (),
    module_version: str | None = None,
) -> None:
    """A pure-Python wheel of module ``name`` with a console script ``name``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": (
            f"__version__ = {module_version or version!r}\n"
            f"def main():\n    print({name!r}, __version__)\n"
        ),
        f"{dist}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: oldgpu-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
        f"{dist}/entry_points.txt": f"[console_scripts]\n{name} = {name}:main\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheelhouse / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
