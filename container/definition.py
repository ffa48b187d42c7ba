"""Read the sections of container/relax.def that tools/build-image-root replays in a chroot.

    python3 container/definition.py DEF header KEY          a header value (OSVersion, MirrorURL)
    python3 container/definition.py DEF section NAME [ARG=VALUE ...]
                                                       a section's body ({{ ARG }} replaced)

Apptainer reads the same file; build-image-root takes every step from here so the two cannot drift.
"""

from __future__ import annotations

import re
import sys


def header(text: str, key: str) -> str:
    for line in text.splitlines():
        if line.startswith("%"):
            break
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    raise SystemExit(f"definition: no {key}: header in the definition")


def section(text: str, name: str, args: dict[str, str]) -> str:
    """The lines of %name up to the next section, dedented, with {{ arg }} replaced."""
    match = re.search(rf"^%{name}[ \t]*\n(.*?)(?=^%|\Z)", text, re.S | re.M)
    if match is None:
        raise SystemExit(f"definition: no %{name} section in the definition")
    body = "\n".join(line[4:] if line.startswith("    ") else line.lstrip() for line in match.group(1).splitlines())
    defaults = dict(line.split("=", 1) for line in (section(text, "arguments", {}).split() if name != "arguments" else []))

    def value(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in {**defaults, **args}:
            raise SystemExit(f"definition: {{{{ {key} }}}} in %{name} has no value (%arguments or ARG=VALUE)")
        return {**defaults, **args}[key]

    return re.sub(r"\{\{\s*(\w+)\s*\}\}", value, body).strip() + "\n"


def main(argv: list[str]) -> None:
    path, kind, name, *rest = argv
    text = open(path, encoding="utf-8").read()
    if kind == "header":
        print(header(text, name))
    else:
        sys.stdout.write(section(text, name, dict(arg.split("=", 1) for arg in rest)))


if __name__ == "__main__":
    main(sys.argv[1:])
