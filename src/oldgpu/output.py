"""One way to answer: a JSON document for machines, text for people.

Every command returns a ``Result``; the CLI prints ``payload`` as JSON with
``--json`` and ``text`` otherwise, and exits with ``code``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class Result:
    payload: Any
    text: str = ""
    code: int = 0

    def emit(self, as_json: bool) -> int:
        if as_json:
            json.dump(self.payload, sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
        elif self.text:
            sys.stdout.write(self.text.rstrip("\n") + "\n")
        return self.code


class EngineError(RuntimeError):
    """An error with a name a person can search for and a fix to apply.

    ``code`` is the process exit status the CLI uses for it.
    """

    code = 2

    def __init__(self, name: str, message: str, *, code: int | None = None) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message
        if code is not None:
            self.code = code

    def as_dict(self) -> dict[str, Any]:
        return {"error": self.name, "message": self.message}


def read_json(name: str, error: str, what: str, *, code: int = 4) -> Any:
    """The JSON document in file ``name`` (``-``: standard input).

    A file that cannot be read, is not UTF-8 or is not JSON is the named error
    ``error`` about ``what``, never a traceback.
    """
    try:
        if name == "-":
            return json.load(sys.stdin)
        with open(name, encoding="utf-8") as source:
            return json.load(source)
    except OSError as exc:
        raise EngineError(
            error, f"cannot read {what} from {name}: {exc.strerror}", code=code
        ) from None
    except ValueError as exc:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        raise EngineError(error, f"{what} ({name}): not JSON: {exc}", code=code) from None
    except RecursionError:  # "[[[[…": json's decoder recurses once per level
        raise EngineError(error, f"{what} ({name}): nested too deeply", code=code) from None
