"""JUnit XML from ``logdiff check`` gates: one test case per gate.

CI systems (GitLab, Jenkins, GitHub test-report actions) read JUnit XML and show
each test case by name; a failed gate becomes a ``<failure>`` whose message and
text carry the value and the threshold, so the numbers are visible without
opening the log. Gates arrive as plain dicts (``name``, ``passed``, ``value``,
``threshold``, ``message``), so this module imports nothing else of logdiff.
ElementTree escapes markup; characters XML 1.0 cannot hold are dropped first.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

CLASSNAME = "logdiff.commands.check"
_ILLEGAL_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _text(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.6g}"
    return _ILLEGAL_XML.sub("", str(value))


def junit_xml(
    gates: list[dict[str, Any]],
    *,
    suite: str = "logdiff check",
    properties: dict[str, Any] | None = None,
    time_s: float = 0.0,
) -> str:
    """The XML document (a ``<testsuites>`` with one ``<testsuite>``) as a string."""
    failures = sum(1 for g in gates if not g.get("passed"))
    common = {"tests": str(len(gates)), "failures": str(failures), "errors": "0", "skipped": "0",
              "time": f"{time_s:.3f}"}  # fmt: skip
    root = ET.Element("testsuites", {"name": _text(suite), **common})
    ts = ET.SubElement(root, "testsuite", {"name": _text(suite), **common})
    if properties:
        props = ET.SubElement(ts, "properties")
        for key, value in properties.items():
            ET.SubElement(props, "property", {"name": _text(key), "value": _text(value)})
    for gate in gates:
        case = ET.SubElement(ts, "testcase", {"classname": CLASSNAME, "name": _text(gate.get("name")), "time": "0"})
        numbers = f"value: {_text(gate.get('value'))}\nthreshold: {_text(gate.get('threshold'))}"
        if gate.get("passed"):
            ET.SubElement(case, "system-out").text = f"{numbers}\n{_text(gate.get('message'))}"
        else:
            failure = ET.SubElement(case, "failure", {"message": _text(gate.get("message")), "type": "GateFailed"})
            failure.text = f"{_text(gate.get('message'))}\n{numbers}"
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
