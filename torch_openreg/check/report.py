"""The three output formats of the check: a table for people, JSON for tools, JUnit XML for CI."""

from __future__ import annotations

import json
import textwrap
from xml.etree import ElementTree as ET

from .runner import Result


def summary(results: list[Result]) -> str:
    failed = [r for r in results if not r.passed]
    required = [r for r in failed if r.required]
    seconds = sum(r.seconds for r in results)
    return (f"{len(results) - len(failed)} passed, {len(failed)} failed "
            f"({len(required)} required) in {seconds:.1f} s")


def table(results: list[Result], device: str, header: str = "") -> str:
    width = max((len(r.name) for r in results), default=10)
    lines = [f"PrivateUse1 contract check of device {device!r}{header}", ""]
    for r in results:
        status = "PASS" if r.passed else "FAIL"
        kind = "required" if r.required else "optional"
        lines.append(f"{status}  {r.name:<{width}}  {kind}  {r.mechanism}  [{r.guide}]")
        pad = " " * (8 + width)
        body = r.detail if r.passed else f"reason: {r.detail}"
        lines += textwrap.wrap(body, 100, initial_indent=pad, subsequent_indent=pad + "  ") or []
        if not r.passed:
            lines += textwrap.wrap(f"fix: {r.fix} (see {r.guide})", 100, initial_indent=pad,
                                   subsequent_indent=pad + "  ")
    lines += ["", summary(results)]
    return "\n".join(lines)


def as_json(results: list[Result], device: str, torch_version: str) -> str:
    return json.dumps({
        "device": device,
        "torch": torch_version,
        "passed": sum(r.passed for r in results),
        "failed": sum(not r.passed for r in results),
        "required_failed": sum(r.required and not r.passed for r in results),
        "results": [r.to_dict() for r in results],
    }, indent=2)


def junit(results: list[Result], device: str) -> str:
    """Required failures are <failure>s; optional ones are <skipped> with their reason."""
    suite = ET.Element("testsuite", name=f"privateuse1-contract[{device}]", tests=str(len(results)),
                       failures=str(sum(r.required and not r.passed for r in results)),
                       skipped=str(sum(not r.required and not r.passed for r in results)),
                       time=f"{sum(r.seconds for r in results):.3f}")
    for r in results:
        case = ET.SubElement(suite, "testcase", classname=f"contract.{device}", name=r.name,
                             time=f"{r.seconds:.3f}")
        if r.passed:
            continue
        text = f"{r.detail}\nfix: {r.fix}\nguide: {r.guide}"
        if r.required:
            ET.SubElement(case, "failure", message=r.detail).text = text
        else:
            ET.SubElement(case, "skipped", message=f"optional: {r.detail}").text = text
    suites = ET.Element("testsuites")
    suites.append(suite)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True)
