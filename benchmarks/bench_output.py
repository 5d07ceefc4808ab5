"""How a benchmark hands over its result: the JSON on stdout, and the same in ``--out``.

HiGHS prints its banner on stdout, so the file, not stdout, is the clean copy to keep.
"""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None, **dumps) -> None:
    """Print ``result`` as JSON (``json.dumps`` options in ``dumps``, indent 1 by default)
    and write the same text to ``out`` when given."""
    text = json.dumps(result, **{"indent": 1, **dumps})
    print(text)
    if out:
        Path(out).write_text(text + "\n")
