"""kareus's version, and the build its caches key their records by."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__version__ = "0.1.0"


@functools.cache
def build() -> str:
    """``__version__`` with a digest of kareus's source, as Inductor keys its caches by
    torch's (``torch_key``): what the profile store and the stored plans key their records
    by, so that a measurement made by other code (before a placement rule changed what a
    partition's workload is, say) is measured again rather than reused under the same
    version number."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"{__version__}+{digest.hexdigest()[:12]}"
