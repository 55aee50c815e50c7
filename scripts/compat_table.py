"""Render the (architecture x PEFT method) support table from the exactness tests' results.

python -m pytest tests/test_exactness.py -k inprocess --junitxml=/tmp/exact.xml
python scripts/compat_table.py /tmp/exact.xml
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET

CASE = re.compile(
    r"test_split_equals_vanilla\[(?P<transport>[^-]+)-(?P<arch>.+)-(?P<method>[^-]+)\]"
)


def outcomes(xml_path: str) -> dict[tuple[str, str], str]:
    table = {}
    for case in ET.parse(xml_path).iter("testcase"):
        match = CASE.fullmatch(case.get("name", ""))
        if not match:
            continue
        if case.find("skipped") is not None:
            outcome = "n/a¹"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "FAIL"
        else:
            outcome = "✓"
        table[(match["arch"], match["method"])] = outcome
    return table


def render(table: dict[tuple[str, str], str]) -> str:
    archs = sorted({arch for arch, _ in table})
    methods = sorted({method for _, method in table})
    lines = ["| architecture | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for arch in archs:
        cells = [table.get((arch, method), "") for method in methods]
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(outcomes(sys.argv[1])))
