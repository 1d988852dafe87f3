"""What molecule/shared/interrupt.py killed in a scenario's prepare, as the tests read it."""

from __future__ import annotations

import re

from interrupt import RECORD


def kills(host) -> dict[str, str]:
    """One line per fault, by its name: 'kill host at 41 s while ...; converge rc 2; ...'."""
    text = host.file(RECORD).content_string
    return dict(re.findall(r"^([\w-]+): (.*)$", text, re.M))
