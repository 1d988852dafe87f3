#!/usr/bin/env python3
"""Pack the engine's package into a reproducible tarball on the controller.

The same source always gives the same bytes (sorted names, fixed owners and
times, no byte-code), so its hash names the release and a converge of an
unchanged engine copies nothing. Prints {"path": ..., "sha256": ...}.
"""

import gzip
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

src, cache = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
files = sorted(
    p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
)
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for path in files:
        data = path.read_bytes()  # follows links: data/pins.json is files/pins.json
        info = tarfile.TarInfo(f"oldgpu/{path.relative_to(src).as_posix()}")
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        tar.addfile(info, io.BytesIO(data))
payload = gzip.compress(buf.getvalue(), mtime=0)
digest = hashlib.sha256(payload).hexdigest()
cache.mkdir(parents=True, exist_ok=True)
out = cache / f"oldgpu-engine-{digest[:16]}.tar.gz"
if not out.exists():
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(payload)
    tmp.replace(out)
print(json.dumps({"path": str(out), "sha256": digest, "files": len(files)}))
