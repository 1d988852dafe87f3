#!/usr/bin/python
"""Add components (contrib, non-free, ...) to the distribution's own apt sources.

Edits the host's existing entries in place, deb822 (*.sources) or one-line
(sources.list, *.list), whichever it has, so no mirror host is ever written by
us. Only entries for the distribution's own archive are touched: their suites
are the release codename or its -updates/-security/-backports, and third-party
repositories (other keyrings, other suites) are left as they are.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: apt_components
short_description: Enable components on the distribution's existing apt sources
description:
  - Adds the given components to every deb822 stanza and one-line entry whose
    suite is I(codename) or one of its -updates, -security, -backports suites.
  - Supports check mode and diff mode.
options:
  codename:
    description: The release codename, e.g. bookworm.
    type: str
    required: true
  components:
    description: Components that must be enabled.
    type: list
    elements: str
    required: true
  paths:
    description: Files to consider; missing ones are skipped.
    type: list
    elements: path
    default: [/etc/apt/sources.list]
  globs:
    description: Directories whose *.list and *.sources files are considered too.
    type: list
    elements: path
    default: [/etc/apt/sources.list.d]
"""

RETURN = r"""
files:
  description: The files that were (or in check mode would be) changed.
  type: list
  returned: always
entries:
  description: Number of entries of the distribution found.
  type: int
  returned: always
"""

import glob
import os
import re

from ansible.module_utils.basic import AnsibleModule

SUFFIXES = ("", "-updates", "-security", "-backports")


def _ours(suite: str, codename: str) -> bool:
    return suite.rstrip("/") in {codename + s for s in SUFFIXES}


def edit_deb822(text: str, codename: str, components: list[str]) -> tuple[str, int]:
    """Add components to each stanza whose Suites are all the distribution's."""
    found = 0
    out = []
    # Stanzas are separated by blank lines; keep separators exactly.
    for chunk in re.split(r"(\n\s*\n)", text):
        suites = re.search(r"^Suites:[ \t]*(.+)$", chunk, re.M | re.I)
        comps = re.search(r"^(Components:[ \t]*)(.*)$", chunk, re.M | re.I)
        enabled = not re.search(r"^Enabled:[ \t]*no\b", chunk, re.M | re.I)
        if (
            suites
            and comps
            and enabled
            and all(_ours(s, codename) for s in suites.group(1).split())
        ):
            found += 1
            have = comps.group(2).split()
            missing = [c for c in components if c not in have]
            if missing:
                line = comps.group(1) + " ".join(have + missing)
                chunk = chunk[: comps.start()] + line + chunk[comps.end() :]
        out.append(chunk)
    return "".join(out), found


ONE_LINE = re.compile(
    r"^(?P<head>\s*deb(?:-src)?\s+(?:\[[^\]]*\]\s+)?\S+\s+)"  # type, [options], URI
    r"(?P<suite>\S+)"
    r"(?P<comps>(?:[ \t]+[^\s#]+)*)"
    r"(?P<tail>[ \t]*(?:#.*)?)$"
)


def edit_one_line(text: str, codename: str, components: list[str]) -> tuple[str, int]:
    found = 0
    lines = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        m = ONE_LINE.match(body)
        if m and _ours(m.group("suite"), codename):
            found += 1
            have = m.group("comps").split()
            missing = [c for c in components if c not in have]
            if missing:
                body = (
                    m.group("head")
                    + m.group("suite")
                    + " "
                    + " ".join(have + missing)
                    + m.group("tail")
                )
                line = body + ("\n" if line.endswith("\n") else "")
        lines.append(line)
    return "".join(lines), found


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "codename": {"type": "str", "required": True},
            "components": {"type": "list", "elements": "str", "required": True},
            "paths": {"type": "list", "elements": "path", "default": ["/etc/apt/sources.list"]},
            "globs": {"type": "list", "elements": "path", "default": ["/etc/apt/sources.list.d"]},
        },
        supports_check_mode=True,
    )
    p = module.params
    files = [f for f in p["paths"] if os.path.isfile(f)]
    for d in p["globs"]:
        files += sorted(
            glob.glob(os.path.join(d, "*.list")) + glob.glob(os.path.join(d, "*.sources"))
        )

    changed_files, diffs, entries = [], [], 0
    for path in files:
        with open(path, encoding="utf-8") as fh:
            before = fh.read()
        edit = edit_deb822 if path.endswith(".sources") else edit_one_line
        after, found = edit(before, p["codename"], p["components"])
        entries += found
        if after != before:
            changed_files.append(path)
            diffs.append(
                {"before": before, "after": after, "before_header": path, "after_header": path}
            )
            if not module.check_mode:
                tmp = path + ".oldgpu-tmp"
                with open(tmp, "w", encoding="utf-8") as fh:
                    fh.write(after)
                os.chmod(tmp, os.stat(path).st_mode & 0o7777)
                os.replace(tmp, path)

    if entries == 0:
        module.fail_json(
            msg=f"no apt source entry for {p['codename']} found in {files}: "
            "cannot enable components on a host whose distribution sources are missing",
            files=[],
            entries=0,
        )
    module.exit_json(changed=bool(changed_files), files=changed_files, entries=entries, diff=diffs)


if __name__ == "__main__":
    main()
